"""The profiler sees which kernels each arm launches, on a real GPU."""

from __future__ import annotations

import pytest
import torch

from fp8route.kernels.decode_gemm.launch import decode_gemm
from fp8route.kernels.quantize import quantize_fp8
from fp8route.tuning.kernel_names import kernels_by_arm

pytestmark = pytest.mark.gpu


def test_each_arm_gets_its_own_kernels():
    x = torch.randn(2, 4096, device="cuda").to(torch.bfloat16)
    w = (torch.randn(4096, 4096, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.tensor(0.01, device="cuda")
    q = quantize_fp8(x, s)
    calls = {
        "cublas": lambda: torch._scaled_mm(q, w.t(), s, s, out_dtype=torch.bfloat16),
        "fp8_gemv": lambda: decode_gemm(x, w, s, s, None, torch.bfloat16),
        "quant_then_cublas": lambda: torch._scaled_mm(quantize_fp8(x, s), w.t(), s, s, out_dtype=torch.bfloat16),
    }
    for call in calls.values():
        call()  # compile and warm up outside the profiler
    names = kernels_by_arm(calls)
    assert names["cublas"] and not any("decode_" in k or "quantize" in k for k in names["cublas"]), names
    assert any(k.startswith("decode_") for k in names["fp8_gemv"]), names
    assert names["quant_then_cublas"][0].startswith("_quantize_kernel"), names
    assert names["quant_then_cublas"][1:] == names["cublas"], names
