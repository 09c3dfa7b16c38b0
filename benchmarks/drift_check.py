"""Do long FP8 GEMMs drift while they are timed, and does interleaving the arms even it out?

At M=16384 the tuner put gate_up on cuBLASLt (3040 µs, fast accumulation 3024 with an 8.9% spread)
and the bench of the next process then timed fast accumulation at 2596 µs, 14% ahead, while the
routed arm and the cuBLASLt arm, the same kernel, came out 4% apart (`results/h200/routing/
placement8/`). Timed arm after arm, a GEMM of 3 ms per call runs 30 calls in a row, long enough
for the clocks to move under the power limit. This times the tuner's arms on one shape both ways,
arm after arm (the old timing) and interleaved (timing.time_arms now), a few attempts each, and
prints per attempt each arm's median, the spread of its two reps and the ratio of the two cuBLASLt
modes. Run it with `nvidia-smi -lms` logging the clocks alongside.

    PYTHONPATH=$PWD python3 benchmarks/drift_check.py --out DIR
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

from fp8route.backends import BACKENDS
from fp8route.tuning.timing import ArmTiming, time_arms, time_cold
from fp8route.tuning.workload import Workload

MODES = {"arm after arm": functools.partial(time_arms, timer=time_cold), "interleaved": time_arms}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n", type=int, default=28672)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--ms", default="8192,16384")
    ap.add_argument("--arms", default="cublas,cublas_fast,rowwise")
    ap.add_argument("--attempts", type=int, default=3)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    workload = Workload(args.n, args.k)
    runs = {name: BACKENDS[name].run for name in args.arms.split(",")}
    rows = []
    began = time.time()
    for m in (int(v) for v in args.ms.split(",")):
        for attempt in range(args.attempts):
            for mode, timer in MODES.items():
                timed = workload.time(runs, m, timer=timer)
                row = {"m": m, "attempt": attempt, "mode": mode, "t_s": round(time.time() - began, 2)}
                for name, t in timed.items():
                    assert isinstance(t, ArmTiming), f"{name}: {t}"
                    row[name] = {"median_us": t.median_us, "reps": list(t.rep_medians_us), "spread": t.spread}
                rows.append(row)
                cells = "  ".join(
                    f"{name} {row[name]['median_us']:8.1f} ({100 * row[name]['spread']:4.1f}%)" for name in runs
                )
                if {"cublas", "cublas_fast"} <= runs.keys():
                    cells += f"  cublas/fast {row['cublas']['median_us'] / row['cublas_fast']['median_us']:.3f}"
                print(f"M={m:6d} #{attempt} {mode:14s} {cells}", flush=True)
    doc = {"command": " ".join(sys.argv), "n": args.n, "k": args.k, "copies": workload.copies, "rows": rows}
    (args.out / f"drift_{args.n}x{args.k}.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
