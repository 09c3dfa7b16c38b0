"""The activation quantizer's kernel bit for bit against torch's (x / s).clamp(-448, 448).to(float8_e4m3fn):
random values at many scales that are not powers of two, quotients a hair off e4m3's rounding midpoints
(where a quotient one ulp off rounds the other way), signed zeros, saturation, inf and NaN, and lengths
that are no multiple of the kernel's block. test_large_prefill_gpu.py runs it past 2^31 elements.

On a CPU it runs under Triton's interpreter (TRITON_INTERPRET=1, with the triton extra), whose own e4m3
conversion truncates, carries a rounded-up mantissa into the exponent and does not saturate. The GPU's
is cvt.rn.satfinite (round to nearest even, saturating, NaN kept): a fixture gives the interpreter that
conversion, so what is checked there is the kernel's own code: its loads and masks, the scale it reads,
and the correctly rounded quotient it computes without a division.

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_quantize_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from helpers import GPU_OR_INTERPRETER

from fp8route.kernels.quantize import quantize_fp8

FP8 = torch.float8_e4m3fn
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = GPU_OR_INTERPRETER
SCALES = (0.0371, 1 / 448, 4 / 448, 0.0123, 3.3e-3, 0.7, 1e-5)  # none a power of two: the quotient's rounding matters


@pytest.fixture(autouse=True)
def satfinite_e4m3(gpu_conversions: None) -> None:
    """Every test here converts to e4m3 as the GPU does (tests/kernels/conftest.py)."""


def reference(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x.float() / s).clamp(-448, 448).to(FP8)


def assert_same_bits(x: torch.Tensor, scale: float) -> None:
    s = torch.tensor(scale, device=DEVICE)
    got, want = quantize_fp8(x, s).view(torch.uint8), reference(x, s).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} of {x.numel()} differ, first x={x.flatten()[bad[0]].item()!r} at s={scale}: "
        f"{got.flatten()[bad[0]].item():#04x} against {want.flatten()[bad[0]].item():#04x}"
    )


def midpoints() -> torch.Tensor:
    """The midpoint of every two neighbouring finite e4m3 values, both signs (fp32, exact)."""
    values = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8).float()  # 0 .. 448 (0x7F is NaN)
    mids = (values[1:] + values[:-1]) / 2
    return torch.cat([mids, -mids])


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32] if CUDA else [torch.float16, torch.float32]
)
def test_random_values_at_many_scales_give_torchs_bits(dtype):
    n = (1 << 22) + 5 if CUDA else 3001  # no multiple of the kernel's block
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(n, generator=g) * torch.rand(n, generator=g) * 30).to(DEVICE, dtype)
    for scale in SCALES:
        assert_same_bits(x, scale)


def test_quotients_next_to_the_rounding_midpoints_round_as_the_exact_quotient():
    """x = m * s rounded to fp32, and its two fp32 neighbours: x / s lies within an ulp or two of the
    midpoint m, so a quotient not correctly rounded picks the wrong neighbour of m (or breaks a tie)."""
    up, down = torch.tensor(float("inf")), torch.tensor(-float("inf"))
    for scale in SCALES:
        x = (midpoints() * torch.tensor(scale)).float()
        x = torch.cat([x, torch.nextafter(x, up), torch.nextafter(x, down)])
        assert_same_bits(x.to(DEVICE), scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_zeros_keep_their_sign_and_large_values_saturate(dtype):
    big = torch.finfo(dtype).max
    x = torch.tensor(
        [0.0, -0.0, 1e-9, -1e-9, 447.9, 449.0, -500.0, big, -big, float("inf"), -float("inf")], dtype=dtype
    )
    for scale in (1.0, 0.0371):
        assert_same_bits(x.to(DEVICE), scale)


def test_nan_stays_nan():
    x = torch.tensor([float("nan"), 1.0, -float("nan")], device=DEVICE)
    q = quantize_fp8(x, torch.tensor(0.5, device=DEVICE)).float()
    assert q[0].isnan() and q[2].isnan() and q[1].item() == 2.0
