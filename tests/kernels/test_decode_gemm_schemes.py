"""The decode GEMM in the dynamic schemes: per-channel weight scales with x quantized per token inside
the kernel, and 128x128 block weight scales with x quantized per 1x128 group inside it, against the
schemes' definition (fp8route.schemes) on the same operands: both kernels (CUDA-core and wgmma), split
K, partial blocks and groups (N and K no multiple of 128), a bias, the SiLU * up input. On a CPU
under Triton's interpreter with the GPU's e4m3 conversion (conftest's gpu_conversions); on a GPU as is.

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_decode_gemm_schemes.py
"""

from __future__ import annotations

import pytest
import torch
from helpers import GPU_OR_INTERPRETER

from fp8route.kernels import split_counters
from fp8route.kernels.decode_gemm import launch as decode
from fp8route.kernels.decode_gemm.configs import DecodeConfig
from fp8route.schemes import quantize_activation, quantize_weight, scaled_matmul

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = GPU_OR_INTERPRETER
CUDA_CORE = [DecodeConfig(16, 128, bm, split, num_stages=1, cuda_core=True) for bm, split in ((1, 1), (4, 3))]
MMA = [DecodeConfig(64, 64, 16, split, num_stages=2) for split in (1, 3)]
CONFIGS = CUDA_CORE + MMA + [None]  # None: the kernel's own choice for the shape


def operands(m: int, n: int, k: int, scheme: str, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m)[:, None]).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None]  # rows of different ranges
    wq, ws = quantize_weight(w, scheme)  # type: ignore[arg-type]
    bias = (torch.randn(n, generator=g) * 0.5).to(torch.bfloat16)
    return x, wq, ws, bias


def expected(x: torch.Tensor, wq, ws, bias, scheme: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    xq, xs = quantize_activation(x, scheme)  # type: ignore[arg-type]
    out = scaled_matmul(xq, xs, wq, ws, scheme)  # type: ignore[arg-type]
    return out if bias is None else out + bias.float()


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = ((out.cpu().double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 4e-3, f"{what}: relative error {err:.2e} (bf16 output rounds to ~2e-3)"


@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("n,k", [(192, 576), (200, 400), (128, 256)], ids=str)  # partial blocks, whole ones
def test_the_kernel_gives_the_schemes_product(gpu_conversions, scheme, config, n, k):
    ms = [1, config.block_m] if config is not None and config.cuda_core else [1, 5, 20]  # 20: two token tiles
    for m in ms:
        x, wq, ws, bias = operands(m, n, k, scheme, seed=m + n + k)
        bias = bias if m % 2 else None
        dev = [t.to(DEVICE) if t is not None else None for t in (x, wq, ws, bias)]
        out = decode.decode_gemm(*dev[:3], None, dev[3], torch.bfloat16, config=config, scheme=scheme)
        check(out, expected(x, wq, ws, bias, scheme), f"{scheme} M={m}")


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_split_k_results_repeat_bit_for_bit_and_leave_the_counters_at_zero(gpu_conversions, scheme):
    x, wq, ws, _ = operands(5, 200, 400, scheme, seed=9)
    dev = [t.to(DEVICE) for t in (x, wq, ws)]
    first = decode.decode_gemm(*dev, None, None, torch.bfloat16, config=MMA[1], scheme=scheme)
    assert torch.equal(decode.decode_gemm(*dev, None, None, torch.bfloat16, config=MMA[1], scheme=scheme), first)
    assert not split_counters.left_set(torch.device(DEVICE)), "split-K counters left set"


def test_a_dynamic_scheme_refuses_a_static_scale_and_a_scale_of_another_shape():
    x, wq, ws, _ = operands(2, 192, 576, "block", seed=1)
    with pytest.raises(ValueError, match="pass input_scale=None"):
        decode.decode_gemm(x, wq, ws, torch.tensor(1.0), None, torch.bfloat16, scheme="block")
    with pytest.raises(ValueError, match=r"weight_scale must be fp32 of shape \(2, 5\)"):
        decode.decode_gemm(x, wq, ws[:, :4].contiguous(), None, None, torch.bfloat16, scheme="block")
    with pytest.raises(TypeError, match="channel scheme"):
        decode.decode_gemm(x.to(torch.float8_e4m3fn), wq, torch.ones(192), None, None, torch.bfloat16, scheme="channel")


def test_the_block_scheme_runs_its_own_one_token_tiles_and_the_per_tensor_choice_above() -> None:
    from fp8route.device import DeviceInfo
    from fp8route.kernels.decode_gemm.configs import choose_block_config, choose_config

    device = DeviceInfo.of("cpu")
    for (n, k), split in {(6144, 4096): 1, (4096, 4096): 1, (28672, 4096): 1, (4096, 14336): 2, (256, 300): 1}.items():
        cfg = choose_block_config(1, n, k, device)
        assert (cfg.block_n, cfg.block_m, cfg.split_k, cfg.num_warps, cfg.cuda_core) == (8, 1, split, 2, True)
        assert cfg.block_k % 128 == 0 and decode.block_config(cfg) == cfg, "not block-legal as chosen"
        assert choose_block_config(2, n, k, device) == choose_config(2, n, k, device)
