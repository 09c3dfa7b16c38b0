"""The dynamic activation quantizers (per token, per 1x128 group) bit for bit against their torch
definition (fp8route.schemes.quantize_activation): scales and codes, zero rows, partial last groups,
row strides, and the M-major scale layout cuBLASLt's 1x128 recipe reads. On a CPU under Triton's
interpreter (TRITON_INTERPRET=1) with the GPU's e4m3 conversion (conftest's gpu_conversions).

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_quantize_dynamic.py
"""

from __future__ import annotations

import pytest
import torch
from helpers import GPU_OR_INTERPRETER

from fp8route.schemes import quantize_activation

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = GPU_OR_INTERPRETER
SHAPES = [(1, 576), (3, 1536), (5, 4096), (2, 200), (4, 3000)] + ([(33, 14336), (2049, 4096)] if CUDA else [])


def make_x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]  # rows far apart in range
    if m > 2:
        x[1] = 0  # a zero row still gets a usable scale
    return x.to(DEVICE, dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k", SHAPES, ids=str)
def test_per_token_gives_the_definitions_bits(gpu_conversions, m, k, dtype):
    from fp8route.kernels.quantize import quantize_per_token

    x = make_x(m, k, dtype, seed=m * k)
    q, scale = quantize_per_token(x)
    want_q, want_scale = quantize_activation(x.cpu(), "channel")
    assert torch.equal(scale.cpu(), want_scale) and same_bits(q.cpu(), want_q)


@pytest.mark.parametrize("m_major", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k", SHAPES, ids=str)
def test_per_group_gives_the_definitions_bits(gpu_conversions, m, k, dtype, m_major):
    from fp8route.kernels.quantize import quantize_per_group

    x = make_x(m, k, dtype, seed=m + k)
    q, scale = quantize_per_group(x, m_major=m_major)
    want_q, want_scale = quantize_activation(x.cpu(), "block")
    assert torch.equal(scale.cpu(), want_scale) and same_bits(q.cpu(), want_q)
    if m_major:  # M-contiguous, the leading dimension padded to a multiple of 4
        assert scale.stride(0) == 1 and scale.stride(1) == -(-m // 4) * 4


def test_rows_of_a_wider_tensor_are_read_at_their_stride(gpu_conversions):
    from fp8route.kernels.quantize import quantize_per_group, quantize_per_token

    wide = make_x(3, 1024, torch.bfloat16, seed=5)
    x = wide[:, :600]  # a view: rows 1024 apart
    for kernel, scheme in ((quantize_per_token, "channel"), (quantize_per_group, "block")):
        q, scale = kernel(x)
        want_q, want_scale = quantize_activation(x.cpu(), scheme)
        assert torch.equal(scale.cpu(), want_scale) and same_bits(q.cpu(), want_q)
