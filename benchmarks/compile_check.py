"""Compile fp8_gemv's kernels for sm_90 on any machine (no GPU) and print what each config costs.

Registers and spills (cuobjdump on the cubin, from Triton's bundled CUDA tools), shared memory, and
how many cp.async copies the PTX issues: enough to see whether a config fits before spending device
time on it.

    python3 benchmarks/compile_check.py wgmma 256x128x32x8x3 128x128x16x8x5
    python3 benchmarks/compile_check.py cuda_core 16x2048x1x8x1 --maxnreg 80

A config is block_n x block_k x block_m x num_warps x num_stages.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fp8route.backends.kernels.decode.kernels import decode_cuda_core_kernel, decode_mma_kernel

POINTERS = ("x_ptr", "w_ptr", "out_ptr", "bias_ptr", "ws_ptr", "cnt_ptr", "w_scale_ptr", "in_scale_ptr")
ALIGNED_INTS = ("N", "K", "stride_xm", "stride_wn", "stride_om", "k_per_split")


def compile_config(kernel: str, cfg: str, fused: bool, maxnreg: int) -> str:
    block_n, block_k, block_m, warps, stages = (int(v) for v in cfg.split("x"))
    fn = decode_mma_kernel if kernel == "wgmma" else decode_cuda_core_kernel
    types = dict.fromkeys(POINTERS, "*fp32") | {
        "x_ptr": "*bf16" if fused else "*fp8e4nv",
        "w_ptr": "*fp8e4nv",
        "out_ptr": "*bf16",
        "bias_ptr": "*bf16",
        "cnt_ptr": "*i32",
    }
    constants = dict(
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_M=block_m, QUANT_X=fused, HAS_BIAS=False, USE_WS=True,
        EVEN_K=True, EVEN_N=True, REDUCE_UNROLL=8,
    )  # fmt: skip
    options = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    if kernel == "wgmma":
        constants["IMPRECISE_ACC"] = min(128, block_k)
        options["num_stages"] = stages
    else:
        constants["NUM_STAGES"] = stages
    names = fn.arg_names
    signature = {n: types.get(n, "constexpr" if n in constants else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*POINTERS, *ALIGNED_INTS)}
    compiled = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)  # fmt: skip
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", cubin.name], capture_output=True, text=True)
    regs = re.search(r"REG:(\d+)", usage.stdout)
    spill = re.search(r"LOCAL:(\d+)", usage.stdout)
    cp_async = len(re.findall(r"cp\.async\.c[ag]", ptx))
    return (
        f"{kernel:9s} {cfg:18s} fused={int(fused)} maxnreg={maxnreg or '-':>3}  "
        f"registers {regs.group(1) if regs else '?':>3}  local {spill.group(1) if spill else '?':>3} B  "
        f"shared {compiled.metadata.shared / 1024:6.1f} KB  cp.async {cp_async}"
        "  (static counts in the PTX)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=("wgmma", "cuda_core"))
    ap.add_argument("configs", nargs="+", help="block_n x block_k x block_m x num_warps x num_stages")
    ap.add_argument("--prequant", action="store_true", help="x handed over in fp8 (default: bf16, quantized inside)")
    ap.add_argument("--maxnreg", type=int, default=0)
    args = ap.parse_args()
    for cfg in args.configs:
        print(compile_config(args.kernel, cfg, not args.prequant, args.maxnreg), flush=True)


if __name__ == "__main__":
    main()
