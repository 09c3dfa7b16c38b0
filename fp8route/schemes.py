"""The three FP8 schemes checkpoints use, and their reference numerics in torch.

- tensor: one fp32 weight scale, one input scale (static from the checkpoint, or amax/448 of each x).
- channel: a weight scale per output row, [N]; x quantized per token at run time, a scale per row [M]
  (llm-compressor's FP8_DYNAMIC).
- block: a weight scale per 128x128 block, [ceil(N/128), ceil(K/128)]; x quantized per 1x128 group
  at run time, [M, ceil(K/128)] (DeepSeek-V3, Qwen3-FP8). Edge blocks may be partial.

    tensor, channel: y = (q(x) @ q(w).T) * x_scale * w_scale            (the scales of row m, column n)
    block:           y = sum_g (q(x)_g @ q(w)_g.T) * x_scale[:, g] * w_scale[n // 128, g]

Every backend computes one of these; the functions here are their definition (what the reference
backend and the interpreter tests compare against) and what checkpoints are made with.
"""

from __future__ import annotations

from typing import Literal

import torch

from fp8route.errors import Fp8InputError, Fp8TypeError
from fp8route.quant import FP8_DTYPE, FP8_MAX, check_finite, dynamic_scale, quantize

Scheme = Literal["tensor", "channel", "block"]
SCHEMES: tuple[Scheme, ...] = ("tensor", "channel", "block")
BLOCK = 128  # the block edge of block-scaled weights and the group length of their activations
MIN_SCALE = 1e-12  # a zero row or block still needs a usable scale (as quant.dynamic_scale)
# How explain and reports name each scheme's scales.
DESCRIPTION: dict[str, str] = {
    "tensor": "per-tensor scales",
    "channel": "per-channel weight scales, dynamic per-token input",
    "block": "128x128 block weight scales, dynamic 1x128 input groups",
}


def check_scheme(scheme: str) -> Scheme:
    if scheme not in SCHEMES:
        raise Fp8InputError(f"unknown FP8 scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    return scheme  # type: ignore[return-value]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def weight_scale_shape(scheme: Scheme, n: int, k: int) -> tuple[int, ...]:
    """The shape a weight [N, K]'s fp32 scale has in a layer (a checkpoint may add a trailing 1)."""
    return {"tensor": (), "channel": (n,), "block": (cdiv(n, BLOCK), cdiv(k, BLOCK))}[scheme]


def check_weight_scale(name: str, scale: torch.Tensor, scheme: Scheme, n: int, k: int) -> torch.Tensor:
    """A checkpoint's weight scale for scheme, checked and returned in the layer's shape as fp32.
    Reads on the host (finite, > 0): load time only. Per-tensor scales go through quant.as_scale."""
    if not isinstance(scale, torch.Tensor):
        raise Fp8TypeError(f"{name}: expected a tensor, got {type(scale).__name__}")
    if not scale.dtype.is_floating_point or scale.dtype in (FP8_DTYPE, torch.float8_e5m2):
        raise Fp8TypeError(f"{name}: expected a float32/bfloat16/float16 scale, got {scale.dtype}")
    shape = weight_scale_shape(scheme, n, k)
    given = tuple(scale.shape)
    if scheme == "channel" and given == (n, 1):
        scale = scale.reshape(n)
    elif given != shape:
        expected = f"({n},) or ({n}, 1)" if scheme == "channel" else str(shape)
        what = "one per output row" if scheme == "channel" else f"one per {BLOCK}x{BLOCK} block, partial edges included"
        raise Fp8InputError(f"{name}: expected shape {expected} ({what} of a [{n}, {k}] weight), got {list(given)}")
    scale = scale.detach().float()
    check_finite(name, scale)
    if bool((scale <= 0).any()):
        raise Fp8InputError(f"{name}: {int((scale <= 0).sum())} scale(s) <= 0; every scale must be > 0")
    return scale.contiguous()


def expand_blocks(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A per-block scale [ceil(rows/128), ceil(cols/128)] as one value per element [rows, cols]."""
    return scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def _blocks_amax(t: torch.Tensor, block_rows: int) -> torch.Tensor:
    """amax of |t| [R, C] over blocks of block_rows x 128 (edges zero-padded) -> [ceil(R/br), ceil(C/128)]."""
    rows, cols = t.shape
    padded = t.new_zeros(cdiv(rows, block_rows) * block_rows, cdiv(cols, BLOCK) * BLOCK)
    padded[:rows, :cols] = t.abs()
    return padded.reshape(padded.shape[0] // block_rows, block_rows, -1, BLOCK).amax(dim=(1, 3))


def quantize_weight(w: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] in scheme: (e4m3 weight, fp32 scale in the layer's shape), amax/448 per
    tensor, row or block."""
    w32 = w.detach().float()
    check_finite("weight", w32)
    if scheme == "tensor":
        scale = dynamic_scale(w32)
        return quantize(w32, scale), scale
    if scheme == "channel":
        scale = (w32.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
        return quantize(w32, scale[:, None]), scale
    scale = (_blocks_amax(w32, BLOCK) / FP8_MAX).clamp(min=MIN_SCALE)
    return quantize(w32, expand_blocks(scale, *w32.shape)), scale


def quantize_activation(x: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] quantized dynamically as scheme says: (e4m3 x, fp32 scale) with scale () per tensor,
    [M] per token (channel) or [M, ceil(K/128)] per 1x128 group (block). The torch reference of the
    Triton quantizers (fp8route.kernels.quantize), bit for bit."""
    x32 = x.float()
    if scheme == "tensor":
        scale = dynamic_scale(x32)
        return quantize(x32, scale), scale
    if scheme == "channel":
        scale = (x32.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
        return quantize(x32, scale[:, None]), scale
    scale = (_blocks_amax(x32, 1) / FP8_MAX).clamp(min=MIN_SCALE)
    return quantize(x32, expand_blocks_columns(scale, x32.shape[1])), scale


def expand_blocks_columns(scale: torch.Tensor, cols: int) -> torch.Tensor:
    """A per-group scale [M, ceil(cols/128)] as one value per element [M, cols]."""
    return scale.repeat_interleave(BLOCK, 1)[:, :cols]


def dequantize_activation(x_q: torch.Tensor, scale: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """The fp32 x [M, K] that x_q and its scale (quantize_activation's) stand for."""
    if scheme == "tensor":
        return x_q.float() * scale
    if scheme == "channel":
        return x_q.float() * scale[:, None]
    return x_q.float() * expand_blocks_columns(scale, x_q.shape[1])


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """The fp32 weight [N, K] that q and its scale stand for."""
    if scheme == "tensor":
        return q.float() * scale
    if scheme == "channel":
        return q.float() * scale[:, None]
    return q.float() * expand_blocks(scale, *q.shape)


def scaled_matmul(
    x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, scheme: Scheme
) -> torch.Tensor:
    """The fp32 product the scheme defines, for x_q [M, K] (e4m3 values, any float dtype holding them)
    and w [N, K] (e4m3 values as they are, or for block already multiplied by their scales: pass
    w_scale None then). One fp32 matmul; the scales applied outside the K sum where they factor out."""
    if scheme == "block":
        wd = w.float() if w_scale is None else dequantize_weight(w, w_scale, "block")
        return dequantize_activation(x_q, x_scale, "block") @ wd.t()
    assert w_scale is not None, "only a block weight carries its scales"
    out = x_q.float() @ w.float().t()
    if scheme == "tensor":
        return out * (x_scale.float() * w_scale.float())
    return out * x_scale.float()[:, None] * w_scale.float()[None, :]
