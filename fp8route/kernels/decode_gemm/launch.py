"""Launching the decode GEMM: argument checks for direct callers, the split-K workspace, the grid."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from fp8route.device import DeviceInfo
from fp8route.errors import Fp8InputError, Fp8TypeError
from fp8route.kernels.decode_gemm.configs import (
    DecodeConfig,
    cdiv,
    choose_block_config,
    choose_config,
    next_power_of_2,
    why_not,
)
from fp8route.kernels.decode_gemm.kernels import decode_cuda_core_kernel, decode_mma_kernel
from fp8route.kernels.launcher import DirectLauncher
from fp8route.kernels.split_counters import counters
from fp8route.quant import FP8_DTYPE
from fp8route.schemes import BLOCK, check_scheme, weight_scale_shape

OUT_DTYPES = (torch.bfloat16, torch.float16)
_REDUCE_UNROLL = 8  # partials summed per round by the last CTA (loads in flight)
_POINTERS = 8  # x, weight, out, bias, workspace, counters, the two scales
_MMA = DirectLauncher(decode_mma_kernel, _POINTERS, pdl=True)
_CUDA_CORE = DirectLauncher(decode_cuda_core_kernel, _POINTERS, pdl=True)


@functools.lru_cache(maxsize=8)
def _device(device: torch.device) -> DeviceInfo:
    return DeviceInfo.of(device)


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
           bias: torch.Tensor | None, out_dtype: torch.dtype, scheme: str = "tensor") -> None:  # fmt: skip
    if x.dim() != 2 or weight.dim() != 2:
        raise Fp8InputError(
            f"decode_gemm: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.shape[1] != weight.shape[1]:
        raise Fp8InputError(f"decode_gemm: x has K={x.shape[1]} but weight has K={weight.shape[1]}")
    if weight.dtype != FP8_DTYPE:
        raise Fp8TypeError(f"decode_gemm: weight must be float8_e4m3fn, got {weight.dtype}")
    x_dtypes = (torch.bfloat16, torch.float16) + ((FP8_DTYPE,) if scheme == "tensor" else ())
    if x.dtype not in x_dtypes:
        raise Fp8TypeError(f"decode_gemm: x must be {' or '.join(map(str, x_dtypes))} ({scheme} scheme), got {x.dtype}")
    if out_dtype not in OUT_DTYPES:
        raise Fp8TypeError(f"decode_gemm: out_dtype must be bfloat16 or float16, got {out_dtype}")
    n, k = weight.shape
    scales = {"weight_scale": (weight_scale, weight_scale_shape(check_scheme(scheme), n, k))}
    if scheme == "tensor":
        if input_scale is None:
            raise Fp8InputError("decode_gemm: the tensor scheme needs a static input_scale")
        scales["input_scale"] = (input_scale, ())
    elif input_scale is not None:
        raise Fp8InputError(f"decode_gemm: the {scheme} scheme quantizes x itself; pass input_scale=None")
    for name, (s, shape) in scales.items():
        if s.numel() != max(1, math.prod(shape)) or s.dtype != torch.float32 or s.device != weight.device:
            got = f"{s.dtype} {tuple(s.shape)} on {s.device}"
            raise Fp8InputError(f"decode_gemm: {name} must be fp32 of shape {shape} on {weight.device}, got {got}")
        if not s.is_contiguous():
            raise Fp8InputError(f"decode_gemm: {name} must be contiguous")
    if bias is not None and (bias.shape != (n,) or bias.dtype != out_dtype or not bias.is_contiguous()):
        got = f"{bias.dtype} {tuple(bias.shape)}"
        raise Fp8InputError(f"decode_gemm: bias must be a contiguous [{n}] {out_dtype} tensor, got {got}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise Fp8InputError("decode_gemm: x and weight need a contiguous last (K) dimension")
    reason = why_not(x.shape[0], n, k)
    if reason is not None:
        raise Fp8InputError(f"decode_gemm: {reason}")


def decode_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    scheme: str = "tensor",
) -> torch.Tensor:
    """The scheme's product (fp8route.schemes) for x [M, K] and an e4m3 weight [N, K], plus bias; fp32
    accumulation, out [M, N] in out_dtype. tensor: (q(x) @ weight.T) * input_scale * weight_scale, x
    bf16/fp16 or e4m3 already quantized with input_scale. channel, block: x bf16/fp16, quantized per
    token or 1x128 group inside the kernel; weight_scale [N] or [ceil(N/128), ceil(K/128)].

    No host sync and no data-dependent allocation: safe inside CUDA-graph capture once the shape
    has run eagerly (the first call allocates the split-K counters). Deterministic.
    """
    _check(x, weight, weight_scale, input_scale, bias, out_dtype, scheme)
    return launch(x, weight, weight_scale, input_scale, bias, out_dtype, out=out, config=config, scheme=scheme)


@dataclass(frozen=True)
class _Launch:
    """What launch derives from a call's shapes and dtypes, once per distinct call."""

    kernel: DirectLauncher
    grid: tuple[int]
    split: int
    k_per_split: int
    tiles: int
    meta: dict[str, Any]


_LAUNCHES: dict[tuple[Any, ...], _Launch] = {}


_SCHEMES = {"tensor": 0, "channel": 1, "block": 2}  # the kernels' SCHEME constexpr


def _plan_launch(m: int, n: int, k: int, device: torch.device, x_fp8: bool, has_bias: bool,
                 config: DecodeConfig | None, scheme: str) -> _Launch:  # fmt: skip
    if scheme == "block":
        cfg = block_config(config or choose_block_config(m, n, k, _device(device)))
    else:
        cfg = config or choose_config(m, n, k, _device(device))
    if cfg.cuda_core and m > cfg.block_m:
        raise Fp8InputError(f"decode_gemm: {cfg} takes at most {cfg.block_m} tokens, got M={m}")
    k_iters = cdiv(k, cfg.block_k)
    split = max(1, min(cfg.split_k, k_iters))
    k_per_split = cdiv(k_iters, split) * cfg.block_k
    split = cdiv(k, k_per_split)  # no empty splits
    tiles = cdiv(n, cfg.block_n) * cdiv(m, cfg.block_m)
    meta: dict[str, Any] = dict(
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M=cfg.block_m,
        QUANT_X=not x_fp8, HAS_BIAS=has_bias, USE_WS=split > 1,
        EVEN_K=k_per_split * split == k, EVEN_N=n % cfg.block_n == 0, REDUCE_UNROLL=_REDUCE_UNROLL,
        SCHEME=_SCHEMES[scheme], AMAX_K=_amax_step(k, cfg.block_m),
        num_warps=cfg.num_warps, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )  # fmt: skip
    if cfg.cuda_core:
        kernel, meta["NUM_STAGES"] = _CUDA_CORE, cfg.num_stages
    else:
        kernel, meta["IMPRECISE_ACC"], meta["num_stages"] = _MMA, min(128, cfg.block_k), cfg.num_stages
    return _Launch(kernel, (tiles * split,), split, k_per_split, tiles, meta)


def _amax_step(k: int, block_m: int) -> int:
    """K per step of the channel scheme's row-amax prologue: about 8192 x elements a step (a whole
    decode row in one or a few steps; 128-wide steps made M=1 GEMMs 2x slower on the H200)."""
    return max(BLOCK, min(next_power_of_2(k), 8192 // next_power_of_2(block_m)))


def block_config(cfg: DecodeConfig) -> DecodeConfig:
    """cfg for 128x128 block weights: the wgmma kernel scales each step's product by its group's
    scales, so a step is one 128-wide group; the CUDA-core kernel's steps are whole groups and its
    tiles inside one block row."""
    if not cfg.cuda_core:
        return replace(cfg, block_k=128)
    assert BLOCK % cfg.block_n == 0, f"{cfg}: a CUDA-core tile must lie inside one {BLOCK}-row block"
    return replace(cfg, block_k=max(BLOCK, cfg.block_k))


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    scheme: str = "tensor",
) -> torch.Tensor:
    """decode_gemm without the argument checks, for callers whose plan already vetted the layer and
    whose forward checked x: the checks cost microseconds of host time on every decode step. scheme
    (fp8route.schemes): tensor takes the static input_scale; channel and block take none and quantize
    x per token or group themselves."""
    m = x.shape[0]
    n, k = weight.shape
    stride_xm, stride_wn = x.stride(0), weight.stride(0)
    # Every integer argument and dtype the kernel specializes on; the launcher adds alignment.
    key = (m, n, k, stride_xm, stride_wn, x.dtype, out_dtype, bias is None, x.device, config, scheme)
    plan = _LAUNCHES.get(key)
    if plan is None:
        x_fp8 = x.dtype == FP8_DTYPE
        plan = _LAUNCHES[key] = _plan_launch(m, n, k, x.device, x_fp8, bias is not None, config, scheme)
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != out_dtype or out.stride(0) != n or out.stride(1) != 1:
        raise Fp8InputError(f"decode_gemm: out must be a contiguous [{m}, {n}] {out_dtype} tensor")
    if plan.split > 1:
        ws = torch.empty((plan.split, m, n), dtype=torch.float32, device=x.device)
        cnt = counters(x.device, plan.tiles, "decode_gemm")
    else:
        ws = cnt = out
    args = (
        x, weight, out, bias if bias is not None else out, ws, cnt, weight_scale,
        input_scale if input_scale is not None else weight_scale,
        m, n, k, stride_xm, stride_wn, n, plan.split, plan.k_per_split, cdiv(k, BLOCK),
    )  # fmt: skip
    plan.kernel(plan.grid, key, args, plan.meta)
    return out
