"""The block-scaled GEMM (fp8route.kernels.block_gemm) against the block scheme's definition: x
quantized per group inside the kernel or handed over quantized with its scales, partial blocks and
groups (N and K no multiple of 128), several token tiles in grouped order, a bias. On a CPU under
Triton's interpreter with the GPU's float conversions (conftest's gpu_conversions); on a GPU as is.

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_block_gemm.py
"""

from __future__ import annotations

import pytest
import torch
from helpers import GPU_OR_INTERPRETER

from fp8route.kernels.block_gemm import CONFIGS, BlockGemmConfig, block_gemm, config_for
from fp8route.schemes import quantize_activation, quantize_weight, scaled_matmul

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = GPU_OR_INTERPRETER
SMALL = [BlockGemmConfig(16, 64, 1, 4, 2), BlockGemmConfig(32, 32, 2, 4, 2)]


def operands(m: int, n: int, k: int, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m)[:, None]).to(torch.bfloat16)
    wq, ws = quantize_weight(torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None], "block")
    return x, wq, ws, (torch.randn(n, generator=g) * 0.5).to(torch.bfloat16)


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = ((out.cpu().double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 4e-3, f"{what}: relative error {err:.2e} (bf16 output rounds to ~2e-3)"


@pytest.mark.parametrize("prequantized", [False, True])
@pytest.mark.parametrize("config", SMALL + ([None] if CUDA else []), ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 192, 576), (37, 200, 400), (70, 128, 256)], ids=str)
def test_the_kernel_gives_the_block_schemes_product(gpu_conversions, m, n, k, config, prequantized):
    x, wq, ws, bias = operands(m, n, k, seed=m + n)
    bias = bias if m % 2 else None
    xq, xs = quantize_activation(x, "block")
    ref = scaled_matmul(xq, xs, wq, ws, "block") + (bias.float() if bias is not None else 0)
    dev = [t.to(DEVICE) if t is not None else None for t in (x, wq, ws, bias, xq, xs)]
    if prequantized:
        out = block_gemm(dev[4], dev[1], dev[2], dev[3], torch.bfloat16, x_scale=dev[5], config=config)
    else:
        out = block_gemm(dev[0], dev[1], dev[2], dev[3], torch.bfloat16, config=config)
    check(out, ref, f"M={m} {config}")


def test_every_m_has_a_config_and_bad_scales_are_refused():
    assert config_for(1) == CONFIGS[0][1] and config_for(10**9) == CONFIGS[-1][1]
    x, wq, ws, _ = operands(2, 192, 576, seed=0)
    with pytest.raises(ValueError, match=r"weight_scale must be fp32 \(2, 5\)"):
        block_gemm(x, wq, ws[:, :4].contiguous(), None, torch.bfloat16)
    with pytest.raises(TypeError, match="x must be"):
        block_gemm(x.to(torch.float8_e4m3fn), wq, ws, None, torch.bfloat16)
