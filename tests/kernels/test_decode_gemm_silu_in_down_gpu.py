"""The decode GEMM with SiLU(gate) * up computed inside it (the kernel option silu_in_down) against
the unfused path it replaces, fp8route.kernels.fused.silu_mul then the same GEMM: bit for bit, in
bf16 and fp16, at every decode bucket, on the 8B's and TP4's down shapes and one that needs every
mask; a gate_up of the wrong width or dtype refused with a reason.

Under Triton's interpreter (CPU tensors) both kernels run too, with and without split-K, which is
how the GATED loads were checked before a GPU saw them:

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_decode_gemm_silu_in_down_gpu.py
"""

from __future__ import annotations

import os

import pytest
import torch

from fp8route.errors import Fp8InputError, Fp8TypeError
from fp8route.kernels.decode_gemm.configs import DecodeConfig
from fp8route.kernels.decode_gemm.launch import decode_gemm, decode_gemm_silu_mul, launch
from fp8route.kernels.fused import silu_mul
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.interpreter,
    pytest.mark.skipif(
        TRITON_IMPORT_ERROR is not None or not (torch.cuda.is_available() or INTERPRET),
        reason="needs triton, and CUDA or TRITON_INTERPRET=1",
    ),
]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FP8 = torch.float8_e4m3fn
SHAPES = [(4096, 14336), (4096, 3584), (208, 400)]  # (N, K): down of the 8B at TP1 and TP4, and all masks
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 96, 128)  # fp8route.engine.decode_graphs.buckets up to the kernel's M


def operands(n: int, k: int, m: int, dtype: torch.dtype, seed: int = 0, device: str = "cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    gate_up = (torch.randn(m, 2 * k, device=device, generator=g) * 3).to(dtype)
    w = (torch.randn(n, k, device=device, generator=g) * 120).clamp(-448, 448).to(FP8)
    s_w = torch.tensor(0.0027, device=device)
    s_in = torch.tensor(0.01, device=device)  # some SiLU * up values saturate
    return gate_up, w, s_w, s_in


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's check; on a GPU the tests below cover it")
@pytest.mark.parametrize("k", [192, 208])  # K a multiple of the tile, and not (the masked loads)
@pytest.mark.parametrize(
    "config",
    [DecodeConfig(block_n=64, block_k=64, block_m=16, split_k=split, num_warps=4, num_stages=2) for split in (1, 2)]
    + [
        DecodeConfig(block_n=16, block_k=64, block_m=8, split_k=split, num_stages=1, cuda_core=True) for split in (1, 2)
    ],
    ids=str,
)
def test_the_gated_loads_give_the_unfused_gemm_under_the_interpreter(config, k):
    # fp16: the interpreter has no bfloat16. 20 tokens: two token tiles of the wgmma kernel.
    for m in (1, 5, 8) if config.cuda_core else (1, 5, 16, 20):
        gate_up, w, s_w, s_in = operands(80, k, m, torch.float16, seed=m, device="cpu")
        unfused = launch(silu_mul(gate_up, k).contiguous(), w, s_w, s_in, None, torch.float16, config=config)
        assert torch.equal(launch(gate_up, w, s_w, s_in, None, torch.float16, config=config, gated=True), unfused)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_equals_silu_mul_then_the_gemm(dtype, shape):
    n, k = shape
    for m in BUCKETS:
        gate_up, w, s_w, s_in = operands(n, k, m, dtype, seed=m)
        unfused = decode_gemm(silu_mul(gate_up, k), w, s_w, s_in, None, dtype)
        fused = decode_gemm_silu_mul(gate_up, w, s_w, s_in, None, dtype)
        assert torch.equal(fused, unfused), f"M={m}: {(fused.float() - unfused.float()).abs().max().item()}"
        bias = torch.randn(n, device="cuda").to(dtype)
        assert torch.equal(
            decode_gemm_silu_mul(gate_up, w, s_w, s_in, bias, dtype),
            decode_gemm(silu_mul(gate_up, k), w, s_w, s_in, bias, dtype),
        ), f"M={m} with a bias"


@cuda
def test_a_gate_up_of_the_wrong_width_or_dtype_is_refused():
    gate_up, w, s_w, s_in = operands(208, 400, 4, torch.bfloat16)
    with pytest.raises(Fp8InputError, match=r"gate_up must be \[M, 800\] \(gate, then up\)"):
        decode_gemm_silu_mul(gate_up[:, :799], w, s_w, s_in, None, torch.bfloat16)
    with pytest.raises(Fp8TypeError, match="gate_up must be bfloat16 or float16"):
        decode_gemm_silu_mul(gate_up.float(), w, s_w, s_in, None, torch.bfloat16)
    with pytest.raises(Fp8InputError, match="M=129 is outside 1..128"):
        decode_gemm_silu_mul(gate_up.repeat(33, 1)[:129], w, s_w, s_in, None, torch.bfloat16)
