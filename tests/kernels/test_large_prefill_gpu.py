"""Kernels whose tensors pass 2^31 elements in a large prefill index them with 64-bit offsets: each
runs on such a tensor and its last rows (where 32-bit offsets wrapped) match the torch expression."""

from __future__ import annotations

import pytest
import torch

from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR

gpu = pytest.mark.skipif(not torch.cuda.is_available() or TRITON_IMPORT_ERROR is not None, reason="needs CUDA")
PAST = 2**31 + 2**20  # elements: past int32, by a margin of whole rows


def rows_for(width: int) -> int:
    return -(-PAST // width)


@pytest.fixture(autouse=True)
def free_memory():
    yield
    torch.cuda.empty_cache()


@pytest.mark.gpu
@gpu
def test_silu_mul_past_2_31_elements():
    from fp8route.kernels.fused import silu_mul

    width = 28672  # Llama-3.1-8B's intermediate size: gate_up is M x 57344
    m = rows_for(width)
    gate_up = torch.randn(m, 2 * width, device="cuda", dtype=torch.bfloat16)
    out = silu_mul(gate_up, width)
    tail = gate_up[-4:]
    gate, up = tail.split(width, dim=-1)
    torch.testing.assert_close(out[-4:], torch.nn.functional.silu(gate) * up, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out[:2], silu_mul(gate_up[:2].clone(), width))


@pytest.mark.gpu
@gpu
def test_rms_norms_past_2_31_elements():
    from fp8route.kernels.fused import add_rms_norm, rms_norm, rms_norm_reference

    width = 4096
    m = rows_for(width)
    x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(width, device="cuda", dtype=torch.bfloat16) + 0.5
    torch.testing.assert_close(rms_norm(x, weight, 1e-5)[-4:], rms_norm_reference(x[-4:], weight, 1e-5))
    residual = torch.randn_like(x)
    normed, total = add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(total[-4:], x[-4:] + residual[-4:])
    torch.testing.assert_close(normed[-4:], rms_norm_reference(total[-4:], weight, 1e-5))


@pytest.mark.gpu
@gpu
def test_activation_quantization_past_2_31_elements():
    from fp8route.kernels.quantize import quantize_fp8

    width = 14336  # down_proj's input
    x = torch.randn(rows_for(width), width, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(0.01, device="cuda")
    q = quantize_fp8(x, scale)
    expected = (x[-4:].float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q[-4:].view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
@gpu
def test_rope_past_2_31_elements():
    from fp8route.kernels.fused import rope, rope_reference

    heads, dim = 32, 128
    n = rows_for(heads * dim)
    x = torch.randn(1, n, heads, dim, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(1, n, dim, device="cuda")
    cos, sin = angles.cos(), angles.sin()
    out = rope(x, cos, sin)
    tail = slice(n - 3, n)
    expected = rope_reference(x[:, tail].transpose(1, 2), cos[:, None, tail], sin[:, None, tail])
    torch.testing.assert_close(out[:, :, tail], expected)
