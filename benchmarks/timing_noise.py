"""Where the tuner's disturbed timings came from: the host falling behind the GPU, or the GPU.

Times the same arms many times with two methods and reports, per arm, how far rep medians stray
from the arm's best:
  per_call_sleep  the old method: a 200 µs sleep kernel ahead of each timed call
  queued          fp8route.tuning.timing.time_cold: one sleep long enough for the whole batch,
                  checked afterwards (the batch is timed again if the host fell behind)
For the old method it also records how long the host took to queue each call: a call queued
later than its sleep lasted has host time inside its events.
Then it times the same arms on fresh weight copies (new allocations, shifted by a dummy one) to
see whether where the copies land in memory moves the times.

    PYTHONPATH=. python3 benchmarks/timing_noise.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fp8route.backends import BACKENDS
from fp8route.tuning import timing
from fp8route.tuning.workload import Workload

CASES = [((6144, 4096), 64), ((6144, 4096), 256), ((6144, 4096), 1024), ((28672, 4096), 2), ((4096, 14336), 512)]
ARMS = ("cublas", "cublas_fast", "rowwise", "fp8_gemv")
PER_CALL_SLEEP_US = 200.0


def per_call_sleep(calls, repeats: int = 30, warmup: int = 3) -> tuple[list[float], list[float]]:
    """The old time_cold, plus the host's queueing time of every call (µs)."""
    for i in range(warmup * len(calls)):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    cycles = timing._sleep_cycles(PER_CALL_SLEEP_US)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    host = []
    for i, (start, end) in enumerate(events):
        t0 = time.perf_counter()
        torch.cuda._sleep(cycles)
        start.record()
        calls[i % len(calls)]()
        end.record()
        host.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in events], host


def runs_for(workload: Workload, m: int) -> dict:
    problem = workload.problem(m)
    x = workload.x(m)
    out = {}
    for name in ARMS:
        if BACKENDS[name].why_not(problem) is None:
            out[name] = [lambda layer=layer, name=name: BACKENDS[name].run(x, layer) for layer in workload.layers]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--placements", type=int, default=4)
    args = ap.parse_args()
    result: dict = {"cases": []}
    lines = []
    for (n, k), m in CASES:
        workload = Workload(n, k)
        arms = runs_for(workload, m)
        old = {name: [] for name in arms}
        old_host = {name: [] for name in arms}
        new = {name: [] for name in arms}
        for r in range(args.rounds):
            for name in arms if r % 2 == 0 else list(arms)[::-1]:
                times, host = per_call_sleep(arms[name])
                old[name].append(statistics.median(times))
                old_host[name] += host
                new[name].append(statistics.median(timing.time_cold(arms[name])))
        placed = {name: [] for name in arms}
        for p in range(args.placements):
            shift = torch.empty((p + 1) * 7 * 2**20 + 4096 * p, dtype=torch.uint8, device="cuda")
            fresh = Workload(n, k, seed=p + 1)
            fresh_arms = runs_for(fresh, m)
            for name, calls in fresh_arms.items():
                placed[name].append(statistics.median(timing.time_cold(calls)))
            del fresh, fresh_arms, shift
        case = {"n": n, "k": k, "m": m, "old_rep_medians": old, "old_host_us": old_host, "new_rep_medians": new}
        case["placement_medians"] = placed
        result["cases"].append(case)
        for name in arms:
            o, nw, pl = old[name], new[name], placed[name]
            late = sum(h > PER_CALL_SLEEP_US for h in old_host[name])
            lines.append(
                f"{n}x{k} M={m:5d} {name:11s} per-call-sleep worst/best {max(o) / min(o):5.2f} "
                f"(host late on {late}/{len(old_host[name])} calls, host max {max(old_host[name]):7.0f} µs) | "
                f"queued worst/best {max(nw) / min(nw):5.2f} | fresh placements worst/best {max(pl) / min(pl):5.2f} "
                f"[{min(nw):.2f}..{max(nw):.2f} vs placements {min(pl):.2f}..{max(pl):.2f} µs]"
            )
            print(lines[-1], flush=True)
        del workload, arms
        torch.cuda.empty_cache()
    result["summary"] = lines
    result["batch_counts"] = dict(timing.batch_counts)
    Path(args.out, "timing_noise.json").write_text(json.dumps(result, indent=1))
    print(timing.batch_summary())


if __name__ == "__main__":
    main()
