"""What the deterministic mode's GEMM costs per layer on one GPU: each Llama-3.1-8B projection at M from 1
to 4096, the layer as the default plan runs it (quantizer included) against the same layer in the
deterministic mode (triton_fixed) with each candidate tiling of fp8route.kernels.fixed_gemm, per scheme;
scheme "float" times the 16-bit lm_head (F.linear against the fixed-tile GEMM, as FloatLinear runs them).
Cold L2 (rotating weight copies), interleaved arms, two repetitions (spread reported); every arm
checked against the default's output first, and its bits against triton_fixed's (a tiling the mode may
take must give them: a 16-row tile runs another MMA instruction, so the sweep says whether it does).

    PYTHONPATH=$PWD python3 benchmarks/scripts/fixed_gemm_sweep.py --out $OUT [--schemes tensor,block,float]
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from fp8route.backends.fixed import FixedTilesBackend
from fp8route.bench.decode import SHAPES as PROJECTIONS
from fp8route.kernels import fixed_gemm as fg
from fp8route.linear.layer import Fp8Linear
from fp8route.linear.policy import Policy
from fp8route.routing.fingerprint import Fingerprint
from fp8route.schemes import quantize_weight
from fp8route.tuning.timing import copies_for, time_arms

CANDIDATES = {  # the library's tilings by backend name, then tilings not yet in it
    **fg.TILINGS,
    # x and weight tiles loaded through TMA descriptors (the same bits); 128x256 and 256x128 keep both fp32
    # accumulators (the chunk's and the total) in 255 registers without spilling (compile_check).
    "64x128 tma": fg.FixedTiles(64, 128, 128, 8, 8, 4, 3, 2, tma=True),
    "64x64 tma": fg.FixedTiles(64, 64, 128, 8, 8, 4, 4, tma=True),
    "128x128 s4 tma": fg.FixedTiles(128, 128, 128, 8, 8, 8, 4, 1, tma=True),
    "128x256 s3 tma": fg.FixedTiles(128, 256, 128, 8, 8, 8, 3, 1, tma=True),
    "256x128 s3 tma": fg.FixedTiles(256, 128, 128, 8, 8, 8, 3, 1, tma=True),
}
MS = (1, 16, 64, 256, 1024, 4096)
SHAPES = {**PROJECTIONS, "lm_head": (128256, 4096)}


Call = Callable[[torch.Tensor], torch.Tensor]


def _layers(n: int, k: int, scheme: str, copies: int, gen: torch.Generator) -> tuple[list[Call], list[Callable]]:
    """copies of the layer as the default plan runs it, and each copy's call with a given tiling as the
    deterministic mode runs a tiling backend: (x) -> out, and (x, label) -> out."""
    plain: list[Call] = []
    fixed: list[Callable] = []
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        if scheme == "float":
            w16 = w.to(torch.bfloat16)
            plain.append(lambda x, w16=w16: F.linear(x, w16))
            fixed.append(lambda x, label, w16=w16: fg.launch(x, w16, None, None, None, x.dtype, CANDIDATES[label]))
            continue
        wq, ws = quantize_weight(w, scheme)
        s_in = torch.tensor(4.0 / 448, device="cuda") if scheme == "tensor" else None
        plain.append(Fp8Linear(wq, ws, s_in, scheme=scheme, policy=Policy()))
        operands = Fp8Linear(wq, ws, s_in, scheme=scheme, policy=Policy(deterministic=True)).prepared
        fixed.append(lambda x, label, operands=operands: BACKENDS_BY_LABEL[label].run(x, operands))
    return plain, fixed


# Each candidate as a backend of its own, as the library makes its tilings' (quantizer and all).
BACKENDS_BY_LABEL = {label: FixedTilesBackend(label, tiles) for label, tiles in CANDIDATES.items()}


def _runs(label: str, scheme: str) -> bool:
    """Whether the candidate applies: x quantized inside needs a static scale (the tensor scheme here)
    or 1x128 groups, and a float layer has nothing to quantize."""
    return not CANDIDATES[label].quantize_x or scheme in ("tensor", "block")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--schemes", default="tensor,block")
    parser.add_argument("--shapes", default="tp1_qkv,tp1_o,tp1_gate_up,tp1_down", help="the float scheme: lm_head")
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    first = next(iter(CANDIDATES))
    for backend in BACKENDS_BY_LABEL.values():
        backend.prepare(torch.device("cuda"))
    rows = []
    for scheme in args.schemes.split(","):
        for name in ["lm_head"] if scheme == "float" else args.shapes.split(","):
            n, k = SHAPES[name]
            copies = copies_for(n * k * (2 if scheme == "float" else 1))
            plain, fixed = _layers(n, k, scheme, copies, gen)
            for m in map(int, args.ms.split(",")):
                xs = [torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(copies)]
                ref = plain[0](xs[0]).float()
                arms = {"default plan": [functools.partial(layer, x) for layer, x in zip(plain, xs, strict=True)]}
                family = fixed[0](xs[0], first)  # the bits every tiling of the mode's family must give
                differ = []  # candidates whose rows are not those bits (another K order, another MMA)
                for label in CANDIDATES:
                    if not _runs(label, scheme):
                        continue
                    arms[label] = [functools.partial(fixed[i], xs[i], label) for i in range(copies)]
                    try:
                        got = arms[label][0]()
                    except OutOfResources as exc:  # a tiling too large for this GPU's shared memory
                        print(f"{label}: {exc}", flush=True)
                        del arms[label]
                        continue
                    if not torch.equal(got, family):
                        differ.append(label)
                    err = ((got.float() - ref).norm() / ref.norm()).item()
                    assert err < 1e-2, f"{scheme} {name} M={m} {label}: relative error {err:.2e}"
                timed = time_arms(arms, repeats=20 if m <= 256 else 10)
                base = timed["default plan"].median_us
                row = {"scheme": scheme, "shape": name, "m": m, "default_us": base,
                       "spread": max(t.spread for t in timed.values()), "bits_differ": differ,
                       **{label: timed[label].median_us / base if label in timed else float("inf")
                          for label in CANDIDATES}}  # fmt: skip
                rows.append(row)
                # after every row, so that a run cut short keeps what it timed
                result = {"fingerprint": Fingerprint.of("cuda").to_json(), "rows": rows}
                (args.out / "fixed_gemm_sweep.json").write_text(json.dumps(result, indent=1))
                best = min(CANDIDATES, key=lambda label: row[label])
                print(f"{scheme:6s} {name:12s} M={m:<5d} default {base:8.1f} us  {first} "
                      f"{row[first]:.3f}x  best {best} {row[best]:.3f}x  spread {row['spread']:.3f}  "
                      f"bits differ: {differ}",
                      flush=True)  # fmt: skip
            del plain, fixed
            torch.cuda.empty_cache()
    # Per candidate: its time summed over a model's layers, relative to the default plan's, per M.
    print(f"\n{'scheme':6s} {'M':>5s} " + "".join(f"{label:>18s}" for label in CANDIDATES))
    for scheme in args.schemes.split(","):
        for m in map(int, args.ms.split(",")):
            here = [r for r in rows if r["scheme"] == scheme and r["m"] == m]
            base = sum(r["default_us"] for r in here)
            sums = {label: sum(r[label] * r["default_us"] for r in here) / base for label in CANDIDATES}
            print(f"{scheme:6s} {m:5d} " + "".join(f"{sums[label]:17.3f}x" for label in CANDIDATES))


if __name__ == "__main__":
    main()
