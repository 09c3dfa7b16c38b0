"""Why a decode step waits for the host (issue 48; results/h100/serve_bound/: the same kernels took 3.66 ms
a step in two arms of bench e2e and 3.80 in twelve): rows decoded through the engine as generate runs
them, first timed from the engine's own step accounting, then under torch.profiler. Printed per decode
step: the host's time and the wall time, the GPU's kernel time and its idle gaps between kernels (the
gaps over GAP_US, and where in the step they fall), and the CUDA runtime calls the host made, by name,
with their time (a synchronizing call, a pinned allocation or a pageable copy in the loop shows here).

    python3 benchmarks/scripts/decode_host_profile.py CKPT [--batch 1] [--input 1024] [--steps 32] [--pdl auto] \
        [--kv-cache-dtype auto]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from fp8route.cli.bench_e2e import PDL_ARMS
from fp8route.engine import load_model
from fp8route.engine.config import KV_CACHE_DTYPES
from fp8route.engine.sampling import SamplingParams
from fp8route.tuning.cupti import profiling

GAP_US = 5.0  # an idle stretch between two kernels longer than this counts as a gap


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--input", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--pdl", choices=list(PDL_ARMS), default="auto")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto")
    args = parser.parse_args()
    model = load_model(
        args.path, device=args.device, max_num_seqs=args.batch, max_model_len=args.input + 4 * args.steps + 16,
        enable_prefix_caching=False, record_stats=True, pdl=PDL_ARMS[args.pdl], kv_cache_dtype=args.kv_cache_dtype,
        quiet=True,
    )  # fmt: skip
    engine = model.engine
    gen = torch.Generator().manual_seed(0)
    for label in ("warm-up", "timed", "profiled"):
        prompts = torch.randint(0, model.cfg.vocab_size, (args.batch, args.input), generator=gen).tolist()
        params = SamplingParams(temperature=0, max_tokens=2 * args.steps, ignore_eos=True)
        requests = [engine.add_request(ids, params, request_id=f"{label}-{i}") for i, ids in enumerate(prompts)]
        while any(r.num_output_tokens == 0 for r in requests):  # every prompt prefilled: decode steps from here
            engine.step()
        sync(args.device)
        first = len(engine.stats)
        if label == "profiled":
            with profiling() as prof:
                for _ in range(args.steps):
                    engine.step()
                sync(args.device)
            report_profile(prof, args.steps)
        else:
            for _ in range(args.steps):
                engine.step()
        if label == "timed":
            steps = [s for s in engine.stats[first:] if not s.prefill_tokens]
            host = statistics.median(s.host_s for s in steps) * 1e3
            wall = statistics.median(s.wall_s for s in steps) * 1e3
            print(
                f"decode steps ({len(steps)}, batch {args.batch}, pdl {args.pdl}, kv {args.kv_cache_dtype}): "
                f"host {host:.3f}, wall {wall:.3f} ms"
            )
        for r in requests:
            engine.abort(r.request_id)
        engine.drain()


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def report_profile(prof: torch.profiler.profile, steps: int) -> None:
    cuda = torch.autograd.DeviceType.CUDA
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == cuda)
    if not kernels:
        print("profiled: no GPU kernels recorded")
        return
    busy = sum(end - start for start, end, _ in kernels)
    span = kernels[-1][1] - kernels[0][0]
    gaps, end, last = [], kernels[0][1], kernels[0][2]  # end: the latest any kernel so far ran to
    for start, stop, name in kernels[1:]:
        if start - end > GAP_US:
            gaps.append((start - end, last, name))
        if stop > end:
            end, last = stop, name
    print(f"profiled {steps} steps: GPU span {span / steps / 1e3:.3f} ms a step, kernels {busy / steps / 1e3:.3f} ms")
    print(
        f"gaps over {GAP_US:.0f} us: {len(gaps) / steps:.1f} a step, {sum(g for g, _, _ in gaps) / steps:.1f} us a step"
    )
    by_pair: dict[tuple[str, str], list[float]] = {}
    for gap, before, after in gaps:
        by_pair.setdefault((before[:40], after[:40]), []).append(gap)
    for (before, after), times in sorted(by_pair.items(), key=lambda item: -sum(item[1]))[:8]:
        print(f"  {sum(times) / steps:8.1f} us a step ({len(times)} gaps)  after {before}  before {after}")
    calls: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type != cuda and e.name.startswith("cuda"):
            calls.setdefault(e.name, []).append((e.time_range.end - e.time_range.start) / 1e3)
    print("CUDA runtime calls a step (count, host ms):")
    for name, times in sorted(calls.items(), key=lambda item: -sum(item[1])):
        print(f"  {name:<40} {len(times) / steps:7.2f} {sum(times) / steps:8.3f}")


if __name__ == "__main__":
    main()
