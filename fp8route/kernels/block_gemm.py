"""A Triton GEMM for 128x128 block-scaled FP8 weights (the block scheme, fp8route.schemes), any M.

    out[m, n] = sum_g (q(x)[m, g] @ w[n, g].T) * x_scale[m, g] * w_scale[n // 128, g] + bias[n]

Tiles of BLOCK_M x BLOCK_N, one 128-wide group of K a step: each step's fp32 product is scaled by
its tokens' and its weight block's scales before it is added (the scales do not factor out of the
K sum). x comes as bf16/fp16 and is quantized per 1x128 group inside the step that reads it (no
quantizer launch, no e4m3 copy of x in memory), or already quantized with its [M, ceil(K/128)]
scales. Launch configurations per M range are in CONFIGS; the router decides per layer and M bucket
whether this kernel runs at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fp8route.errors import Fp8InputError, Fp8TypeError
from fp8route.kernels.launcher import DirectLauncher, int_key
from fp8route.kernels.triton_support import tl, triton
from fp8route.quant import FP8_DTYPE
from fp8route.schemes import BLOCK, cdiv

OUT_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class BlockGemmConfig:
    block_m: int
    block_n: int
    group_m: int = 8  # tiles of this many token blocks share weight columns in L2 (grouped order)
    num_warps: int = 4
    num_stages: int = 3


# By the largest M each serves; the last serves every larger M.
CONFIGS: tuple[tuple[int, BlockGemmConfig], ...] = (
    (16, BlockGemmConfig(16, 64, 1, 4, 4)),
    (64, BlockGemmConfig(64, 64, 1, 4, 4)),
    (256, BlockGemmConfig(64, 128, 8, 4, 4)),
    (1 << 62, BlockGemmConfig(128, 128, 8, 8, 3)),
)


def config_for(m: int) -> BlockGemmConfig:
    return next(cfg for m_max, cfg in CONFIGS if m <= m_max)


if triton is not None:
    from fp8route.kernels.pdl import wait_for_inputs
    from fp8route.kernels.quantize import dynamic_scale, quantize_e4m3
    from fp8route.kernels.tile_order import grouped_tile

    @triton.jit(do_not_specialize=["M"])
    def block_gemm_kernel(
        x_ptr, w_ptr, out_ptr, bias_ptr, x_scale_ptr, w_scale_ptr,
        M, N, K, stride_xm, stride_wn, stride_om, stride_xs, stride_ws,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
        QUANT_X: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        wait_for_inputs(USE_PDL)
        pid = tl.program_id(0)
        pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, 128)
        m_mask, n_mask = offs_m < M, offs_n < N
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [128, BLOCK_N], K-major
        w_scale_ptrs = w_scale_ptr + (offs_n // 128) * stride_ws

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, tl.cdiv(K, 128)):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
            else:
                k_mask = g * 128 + offs_k < K
                x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
            if QUANT_X:
                x_scale = dynamic_scale(tl.max(tl.abs(x.to(tl.float32)), axis=1))
                x = quantize_e4m3(x, x_scale[:, None], tl.math.div_rn(1.0, x_scale)[:, None])
            else:
                x_scale = tl.load(x_scale_ptr + offs_m * stride_xs + g, mask=m_mask, other=0.0)
            w_scale = tl.load(w_scale_ptrs + g, mask=n_mask, other=0.0)
            acc += tl.dot(x, w) * (x_scale[:, None] * w_scale[None, :])
            x_ptrs += 128
            w_ptrs += 128

        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    _LAUNCHER = DirectLauncher(block_gemm_kernel, pointers=6, pdl=True)


def block_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    x_scale: torch.Tensor | None = None,
    config: BlockGemmConfig | None = None,
) -> torch.Tensor:
    """The block scheme's product for x [M, K] (bf16/fp16, quantized per group inside; or e4m3 with
    its x_scale [M, ceil(K/128)]) and an e4m3 weight [N, K] with weight_scale [ceil(N/128),
    ceil(K/128)] fp32; out [M, N] in out_dtype. No host sync: graph-safe."""
    _check(x, weight, weight_scale, bias, out_dtype, x_scale)
    return launch(x, weight, weight_scale, bias, out_dtype, x_scale=x_scale, config=config)


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    x_scale: torch.Tensor | None = None,
    config: BlockGemmConfig | None = None,
) -> torch.Tensor:
    """block_gemm without its checks, for a backend whose plan vetted the layer."""
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or config_for(m)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    quant_x = x_scale is None
    meta: dict[str, Any] = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m, QUANT_X=quant_x,
        HAS_BIAS=bias is not None, EVEN_K=k % BLOCK == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    scales = weight_scale if quant_x else x_scale
    assert scales is not None
    args = (
        x, weight, out, bias if bias is not None else out, scales, weight_scale,
        m, n, k, x.stride(0), weight.stride(0), n, scales.stride(0), weight_scale.stride(0),
    )  # fmt: skip
    key = (x.dtype, out_dtype, *int_key(n, k, x.stride(0), weight.stride(0), scales.stride(0), weight_scale.stride(0)))
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    _LAUNCHER(grid, key, args, meta)
    return out


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    x_scale: torch.Tensor | None,
) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise Fp8InputError(
            f"block_gemm: x [M, K] and weight [N, K] expected, got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if weight.dtype != FP8_DTYPE:
        raise Fp8TypeError(f"block_gemm: weight must be float8_e4m3fn, got {weight.dtype}")
    x_dtypes = OUT_DTYPES if x_scale is None else (FP8_DTYPE,)
    if x.dtype not in x_dtypes:
        raise Fp8TypeError(f"block_gemm: x must be {' or '.join(map(str, x_dtypes))} here, got {x.dtype}")
    if out_dtype not in OUT_DTYPES:
        raise Fp8TypeError(f"block_gemm: out_dtype must be bfloat16 or float16, got {out_dtype}")
    (m, k), n = x.shape, weight.shape[0]
    expected = {"weight_scale": (weight_scale, (cdiv(n, BLOCK), cdiv(k, BLOCK)))}
    if x_scale is not None:
        expected["x_scale"] = (x_scale, (m, cdiv(k, BLOCK)))
    for name, (s, shape) in expected.items():
        if tuple(s.shape) != shape or s.dtype != torch.float32 or s.stride(1) != 1:
            raise Fp8InputError(f"block_gemm: {name} must be fp32 {shape} with contiguous rows, got {tuple(s.shape)}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise Fp8InputError(f"block_gemm: bias must be a contiguous [{n}] tensor, got {tuple(bias.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise Fp8InputError("block_gemm: x and weight need a contiguous last (K) dimension")
