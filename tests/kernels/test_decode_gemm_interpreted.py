"""The decode GEMM's two kernels run by Triton's interpreter on a CPU (TRITON_INTERPRET=1, with the
triton extra): the CUDA-core kernel of a few tokens and the wgmma kernel, with and without split-K
and its last-CTA reduction, every mask (K and N off the tile), a bias, against an fp64 product of
the same quantized operands; the split-K counters back at zero after every call.

x is handed over quantized: the interpreter's own e4m3 conversion inside a kernel rounds apart
from torch's (its artifact, not the kernel's), so the in-kernel quantization is checked on the GPU
(tests/kernels/test_decode_gemm_gpu.py). On a GPU these are skipped: the GPU test covers the kernels there.

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_decode_gemm_interpreted.py
"""

from __future__ import annotations

import os

import pytest
import torch

from fp8route.kernels import split_counters
from fp8route.kernels.decode_gemm import launch as decode
from fp8route.kernels.decode_gemm.configs import DecodeConfig
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1" or TRITON_IMPORT_ERROR is not None or torch.cuda.is_available(),
        reason="Triton's interpreter on a CPU: needs triton and TRITON_INTERPRET=1 (on a GPU, its _gpu test covers it)",
    ),
]
FP8 = torch.float8_e4m3fn
CUDA_CORE = [DecodeConfig(16, 64, bm, split, num_stages=1, cuda_core=True) for bm in (1, 4, 8) for split in (1, 3)]
MMA = [DecodeConfig(64, 64, 16, split, num_stages=2) for split in (1, 3)]


def operands(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    s_in, s_w = torch.tensor(0.02), torch.tensor(0.0027)
    xq = (torch.randn(m, k, generator=g) / s_in).clamp(-448, 448).to(FP8)
    w = (torch.randn(n, k, generator=g) * 120).clamp(-448, 448).to(FP8)
    bias = (torch.randn(n, generator=g) * 0.5).to(torch.float16)
    return xq, w, s_w, s_in, bias


def reference(xq, w, s_w, s_in, bias) -> torch.Tensor:
    y = (xq.double() @ w.double().T) * float(s_in) * float(s_w)
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("config", CUDA_CORE + MMA, ids=str)
@pytest.mark.parametrize("n,k", [(48, 256), (40, 400)], ids=str)  # even, and K and N off the tile
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_gives_the_fp64_product_of_its_operands(config: DecodeConfig, n: int, k: int, with_bias: bool):
    ms = [1, config.block_m] if config.cuda_core else [1, 5, 16, 20]  # 20: two token tiles
    for m in sorted(set(ms)):
        xq, w, s_w, s_in, bias = operands(m, n, k, seed=m + n)
        bias = bias if with_bias else None
        out = decode.launch(xq, w, s_w, s_in, bias, torch.float16, config=config)
        ref = reference(xq, w, s_w, s_in, bias)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-3, f"M={m}: relative error {err:.2e} (fp16 output rounds to ~3e-4)"
        assert not split_counters.left_set(torch.device("cpu")), "split-K counters left set"


@pytest.mark.parametrize("config", [CUDA_CORE[1], MMA[1]], ids=str)
def test_split_k_results_are_bit_identical_call_after_call(config: DecodeConfig):
    xq, w, s_w, s_in, _ = operands(config.block_m, 40, 400, seed=7)
    first = decode.launch(xq, w, s_w, s_in, None, torch.float16, config=config)
    assert torch.equal(decode.launch(xq, w, s_w, s_in, None, torch.float16, config=config), first)
