"""The block scheme's decode GEMM at small M on one GPU, against the per-tensor one on the same weights'
shape: the configuration it runs today (configs.choose_block_config, made block-legal), and every candidate
CUDA-core configuration, so the fastest can become the block scheme's measured entry (issue 45: batch-1
decode of a block checkpoint within 1.10x of per-tensor). Timed as bench decode times: cold L2 by
rotating weight copies, CUDA events and inside one CUDA graph, each arm checked against the scheme's
fp32 reference first.

    python3 benchmarks/scripts/block_decode_sweep.py --out $OUT [--ms 1,2] [--shapes tp1_qkv,...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from pathlib import Path

import torch

from fp8route.bench.decode import SHAPES, _cuda_core_configs, rel_err
from fp8route.device import DeviceInfo
from fp8route.kernels.decode_gemm.configs import DecodeConfig, choose_block_config
from fp8route.kernels.decode_gemm.launch import block_config, decode_gemm
from fp8route.routing.fingerprint import Fingerprint
from fp8route.schemes import quantize_activation, quantize_weight, scaled_matmul
from fp8route.tuning.timing import copies_for, time_arms, time_cold, time_graph

# (block_n, block_k, num_warps, num_stages[, maxnreg]): block_n divides 128 (one weight-block row per
# tile), block_k whole groups.
BLOCKS = (
    (16, 2048, 8, 1), (16, 1024, 4, 1), (16, 512, 4, 1), (16, 512, 4, 3), (32, 512, 8, 1), (32, 512, 4, 3),
    (16, 256, 2, 3), (16, 128, 1, 3), (8, 512, 2, 3), (64, 256, 8, 3), (32, 1024, 8, 1), (16, 2048, 8, 1, 80),
)  # fmt: skip


def _calls(xs: list[torch.Tensor], ws: list[tuple[torch.Tensor, torch.Tensor]], s_in: torch.Tensor | None,
           scheme: str, cfg: DecodeConfig | None) -> list:  # fmt: skip
    """One call per rotating copy: decode_gemm of copy i's x and weight."""
    return [
        lambda x=x, w=w: decode_gemm(x, w[0], w[1], s_in, None, torch.bfloat16, config=cfg, scheme=scheme)
        for x, w in zip(xs, ws, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ms", default="1")
    parser.add_argument("--shapes", default="tp1_qkv,tp1_o,tp1_gate_up,tp1_down")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = DeviceInfo.of("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, table = [], []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = copies_for(n * k)
        w32 = [torch.randn(n, k, device="cuda", generator=gen) for _ in range(copies)]
        tensor = [quantize_weight(w, "tensor") for w in w32]
        block = [quantize_weight(w, "block") for w in w32]
        del w32
        s_in = torch.tensor(4.0 / 448, device="cuda")
        for m in map(int, args.ms.split(",")):
            xs = [torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(copies)]
            xq, xs_scale = quantize_activation(xs[0], "block")
            ref = scaled_matmul(xq, xs_scale, block[0][0], block[0][1], "block").double()

            weights = {"tensor": (tensor, s_in), "block": (block, None)}

            def calls(scheme: str, cfg: DecodeConfig | None, xs=xs, weights=weights) -> list:  # noqa: ANN001
                return _calls(xs, *weights[scheme], scheme, cfg)

            today = block_config(choose_block_config(m, n, k, device))
            best, best_us = today, float("inf")
            for cfg in _cuda_core_configs(m, n, k, device.sm_count or 132, BLOCKS):
                try:
                    c = calls("block", cfg)
                    err = rel_err(c[0](), ref)
                    us = statistics.median(time_cold(c, repeats=args.repeats, warmup=1))
                except Exception as exc:  # noqa: BLE001 (a config that does not build is a log line)
                    print(f"  {cfg} failed: {exc!r}"[:240], flush=True)
                    continue
                rows.append({"shape": name, "m": m, **asdict(cfg), "us": us, "rel_err": err})
                if err < 2e-2 and us < best_us:
                    best, best_us = cfg, us
            arms = {"tensor": calls("tensor", None), "block_today": calls("block", today),
                    "block_best": calls("block", best)}  # fmt: skip
            errs = {a: rel_err(c[0](), ref) for a, c in arms.items() if a != "tensor"}
            for mode, timer in (("events", None), ("graph", time_graph)):
                kw = {"timer": timer, "repeats": 10} if timer else {"repeats": 40}
                timed = time_arms(arms, **kw)
                us = {a: t.median_us for a, t in timed.items()}
                spread = max(t.spread for t in timed.values())
                table.append({"shape": name, "m": m, "timing": mode, **us, "spread": spread, "errs": errs,
                              "today": asdict(today), "best": asdict(best)})  # fmt: skip
                print(f"{name:12s} M={m} {mode:6s} tensor {us['tensor']:7.2f} block today {us['block_today']:7.2f} "
                      f"({us['block_today'] / us['tensor']:.3f}x) best {us['block_best']:7.2f} "
                      f"({us['block_best'] / us['tensor']:.3f}x) spread {spread:.3f} best={best}",
                      flush=True)  # fmt: skip
        del tensor, block
        torch.cuda.empty_cache()
    result = {"fingerprint": Fingerprint.of("cuda").to_json(), "table": table, "sweep": rows}
    (args.out / "block_decode_sweep.json").write_text(json.dumps(result, indent=1))
    print("\nshape        M timing   tensor us  block today  block best")
    for r in table:
        print(f"{r['shape']:12s} {r['m']} {r['timing']:6s} {r['tensor']:9.2f} {r['block_today'] / r['tensor']:11.3f}x "
              f"{r['block_best'] / r['tensor']:10.3f}x")  # fmt: skip
    for mode in ("events", "graph"):
        one = [r for r in table if r["timing"] == mode and r["m"] == 1]
        sums = {a: sum(r[a] for r in one) for a in ("tensor", "block_today", "block_best")}
        if sums["tensor"]:
            print(f"M=1 layer sum {mode}: tensor {sums['tensor']:.1f} us, block today {sums['block_today']:.1f} "
                  f"({sums['block_today'] / sums['tensor']:.3f}x), block best {sums['block_best']:.1f} "
                  f"({sums['block_best'] / sums['tensor']:.3f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
