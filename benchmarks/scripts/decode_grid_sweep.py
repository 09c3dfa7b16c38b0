"""Issue 47's long-context cost, on the decode kernel alone: rows of the decode-heavy load's lengths
(512 to 2048 positions) under block tables as wide as a 32768 and a 131072 context, at batch 1 to 256,
bf16 and fp8 caches. Per case, one program per split the table's width allows (the kernel before
programs_for), the default (paged_decode.programs_for: four waves), and programs per (row, KV head) sized
for W waves of the SMs, each program running every P-th split of its row. Inside CUDA graphs over several
layers' pools (L2 holds none); every arm checked equal to the first (the same bits by construction).

    PYTHONPATH=$PWD python3 benchmarks/scripts/decode_grid_sweep.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from fp8route.kernels import paged_decode as pd
from fp8route.routing.fingerprint import Fingerprint
from fp8route.tuning.timing import time_graph

H, HKV, D, PAGE = 32, 8, 128, 16  # Llama-3.1-8B's heads, the engine's blocks
LAYERS = 4  # pools per graph: together past the L2 from batch 16 up


def _case(batch: int, width: int, dtype: torch.dtype, gen: torch.Generator):  # type: ignore[no-untyped-def]
    """LAYERS pools holding `batch` rows of 512..2048 positions, tables `width` positions wide."""
    lengths = torch.randint(512, 2049, (batch,), generator=gen)
    per_row = -(-int(lengths.max()) // PAGE)
    tables = torch.zeros(batch, width // PAGE, dtype=torch.int32)
    tables[:, :per_row] = 1 + torch.arange(batch * per_row, dtype=torch.int32).view(batch, per_row)
    shape = (1 + batch * per_row, PAGE, HKV, D)
    scales = (0.05, 0.05) if dtype == torch.float8_e4m3fn else (1.0, 1.0)
    pools = [
        pd.Pages(
            *(torch.randn(shape, device="cuda").to(dtype) for _ in range(2)),
            tables.cuda(),
            torch.arange(batch, device="cuda"),
            *scales,
        )  # fmt: skip
        for _ in range(LAYERS)
    ]
    q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
    return q, pools, lengths.cuda()


def _time(q: torch.Tensor, pools: list[pd.Pages], lengths: torch.Tensor, arms: dict[str, int | None]) -> dict:
    """µs per call of each arm (programs; None: the default), each checked equal to the default first."""
    expected = pd.decode_attention(q, pools[0], lengths)
    samples: dict[str, list[float]] = {name: [] for name in arms}
    for order in (list(arms), list(arms)[::-1]):  # in turn, then mirrored: drift lands on all alike
        for name in order:
            programs = arms[name]
            got = pd.decode_attention(q, pools[0], lengths, programs=programs)
            assert torch.equal(got, expected), f"{name}: not the default's bits"
            calls = [lambda p=p, n=programs: pd.decode_attention(q, p, lengths, programs=n) for p in pools]
            samples[name] += time_graph(calls, repeats=20)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--widths", default="32768,131072")
    parser.add_argument("--waves", default="1,2,4", help="programs sized for this many waves of the SMs")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(0)
    waves = [int(w) for w in args.waves.split(",")]
    rows = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for batch in map(int, args.batches.split(",")):
            for width in map(int, args.widths.split(",")):
                q, pools, lengths = _case(batch, width, dtype, gen)
                splits = min(64, -(-width // pd.split_len(batch * HKV)))
                arms = {"one per split": splits, "default": None} | {
                    f"{w} waves": min(splits, max(1, -(-w * sms // (batch * HKV)))) for w in waves
                }
                times = _time(q, pools, lengths, arms)
                row = {"cache": str(dtype).removeprefix("torch."), "batch": batch, "width": width, "splits": splits,
                       "programs": arms, "us": times}  # fmt: skip
                rows.append(row)
                print(f"{row['cache']:14s} B={batch:<4d} width={width:<7d} splits={splits:<3d} "
                      + "  ".join(f"{n} ({p or splits}) {t:7.1f} us" for (n, p), t in zip(arms.items(), times.values(),
                                                                                      strict=True)),
                      flush=True)  # fmt: skip
                del pools
                torch.cuda.empty_cache()
    result = {"fingerprint": Fingerprint.of("cuda").to_json(), "rows": rows}
    (args.out / "decode_grid_sweep.json").write_text(json.dumps(result, indent=1))
    # Per cache and batch: each arm at the wide table against the default at the narrow one (issue 47: >= 0.98x).
    wide = args.widths.split(",")[-1]
    print(f"\n{'cache':14s} {'batch':>5s}  each arm at {wide} positions wide, vs one per split at the first width")
    for r in rows:
        narrow = next(x for x in rows if x["cache"] == r["cache"] and x["batch"] == r["batch"])
        if r is narrow:
            continue
        base = narrow["us"]["one per split"]
        print(f"{r['cache']:14s} {r['batch']:5d}  " + "  ".join(f"{n} {base / t:.3f}x" for n, t in r["us"].items()))


if __name__ == "__main__":
    main()
