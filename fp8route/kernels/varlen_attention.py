"""Causal attention of fresh chunks over their own keys: FlashAttention-2's varlen kernel, as torch ships it.

A fresh chunk (a prompt's first, from position 0) attends only to its own tokens, so it needs no
read of the paged cache: its rotated K/V, contiguous as the projections leave them, are all it sees.
The varlen kernel runs any number of such chunks packed in one flat batch in one call, each by its
own query offsets (cu [n + 1], on the device), with grouped KV heads as they are, and plans nothing
on the host. On fresh chunks it outruns the paged kernel's multi-query grid (bench attention).

Where it cannot run (a CPU, fp32, a torch built without FlashAttention, a head size it does not
take), varlen_attention_reference is the same attention through SDPA, one chunk at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F


@functools.cache
def _flash_built() -> bool:
    return hasattr(torch.ops.aten, "_flash_attention_forward") and torch.backends.cuda.is_flash_attention_available()


def why_not_varlen(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why varlen_attention cannot run for these heads here (None: it can)."""
    if device.type != "cuda":
        return f"FlashAttention's varlen kernel runs on CUDA GPUs, not {device.type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention's varlen kernel takes float16 and bfloat16, not {str(dtype).removeprefix('torch.')}"
    if head_dim % 8 or head_dim > 256:
        return f"FlashAttention's varlen kernel takes head sizes that are multiples of 8 up to 256, not {head_dim}"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "FlashAttention's varlen kernel needs compute capability 8.0 or newer"
    if not _flash_built():
        return "this torch build has no FlashAttention kernel"
    return None


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int) -> torch.Tensor:
    """q [T, H, D], k and v [T, Hkv, D] (unit stride on D): chunk i is tokens cu[i] .. cu[i + 1] - 1
    (cu int32 on q's device; the first chunk may start past 0) attending causally over its own
    tokens; longest: the most tokens a chunk has (a host bound). -> [T, H, D], the chunks' rows written,
    the others left as they were allocated."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, True, False)[0]


def varlen_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Sequence[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """varlen_attention through SDPA, a chunk at a time; bounds: the chunks' offsets on the host, the
    end last. -> out [T, H, D] (new when not given) with the chunks' rows written."""
    out = torch.empty_like(q) if out is None else out
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        q_i, k_i, v_i = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
        o = F.scaled_dot_product_attention(q_i, k_i, v_i, is_causal=True, enable_gqa=True)
        out[a:b] = o[0].transpose(0, 1).to(out.dtype)
    return out
