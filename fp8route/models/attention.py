"""Attention over the static KV cache: prefill (SDPA, causal) and decode (the Triton split-KV kernel
on CUDA, SDPA under a length mask elsewhere and as its reference), or FlashInfer's for both
(fp8route.models.flashinfer_attention).

Prompts are right-padded, so every row's real tokens sit at positions 0..len-1 and causal
attention alone is correct for each of them: a real token never sees the padding after it. The
padding's own K/V land in the cache past the row's length, where decode overwrites them before
any query can reach them.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fp8route.models import decode_attention as kernel
from fp8route.models.fused import rope, rope_into_cache
from fp8route.models.kv_cache import KVCache

if TYPE_CHECKING:
    from fp8route.models.flashinfer_attention import FlashInferAttention


@functools.cache
def triton_decode_available() -> bool:
    return kernel.TRITON_IMPORT_ERROR is None and torch.cuda.is_available()


def decode_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, limit: int | None = None
) -> torch.Tensor:
    """The reference: q [B, H, D] over the first lengths[b] positions of k/v_cache [B, Hkv, S, D].

    limit (a host int >= every length) trims the read to the cache's filled part; without it the
    whole cache is read under the mask, which has no data-dependent shape (graph-safe)."""
    b = q.shape[0]
    k, v = k_cache[:b], v_cache[:b]
    if limit is not None:
        k, v = k[:, :, :limit], v[:, :, :limit]
    visible = torch.arange(k.shape[2], device=q.device)[None, :] < lengths[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=visible[:, None, None, :], enable_gqa=True)
    return out[:, :, 0]


class PrefillAttention:
    """Writes each layer's K/V for positions 0..T-1 of rows 0..B-1 and attends causally: SDPA, or
    FlashInfer over the cache when given one (planned by the caller for this B and T)."""

    def __init__(self, cache: KVCache, flashinfer: FlashInferAttention | None = None) -> None:
        self.cache, self.flashinfer = cache, flashinfer

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        k, v = rope(k, cos, sin), v.transpose(1, 2)
        self.cache.write_prefill(layer, k, v)
        if self.flashinfer is not None:
            return self.flashinfer.prefill(layer, rope(q, cos, sin, token_major=True))
        return F.scaled_dot_product_attention(rope(q, cos, sin), k, v, is_causal=True, enable_gqa=True)


class DecodeAttention:
    """One new token per row: row b writes its K/V at positions[b] and attends to 0..positions[b].

    positions is a device tensor; limit, when given, is a host bound on positions + 1 that lets
    the torch path read less of the cache (the Triton path reads only each row's filled part
    anyway, and a captured step passes no limit). With a FlashInfer attention (planned for this
    step by the caller), FlashInfer's decode runs instead of either."""

    def __init__(
        self,
        cache: KVCache,
        positions: torch.Tensor,
        limit: int | None = None,
        use_triton: bool | None = None,
        flashinfer: FlashInferAttention | None = None,
    ) -> None:
        self.cache, self.positions, self.limit, self.flashinfer = cache, positions, limit, flashinfer
        self.lengths = positions + 1
        self.use_triton = triton_decode_available() if use_triton is None else use_triton
        self.fuse_new_token: bool | None = None

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        k_cache, v_cache = self.cache.views(layer, q.shape[0])
        if self.flashinfer is None and self.use_triton and q.is_cuda:
            new = kernel.NewToken(k[:, 0], v[:, 0], cos[:, 0], sin[:, 0])
            if self.fuse_new_token is None:  # every layer alike: decided at the first
                self.fuse_new_token = kernel.fuses_new_token(q[:, 0], new)
            if self.fuse_new_token:  # RoPE and the cache write inside the attention kernel
                return kernel.decode_attention(q[:, 0], k_cache, v_cache, self.lengths, new=new)[:, :, None]
        rope_into_cache(k, v, cos, sin, k_cache, v_cache, self.positions)
        q = rope(q, cos, sin)
        if self.flashinfer is not None:
            out = self.flashinfer.decode(layer, q[:, :, 0])
        elif self.use_triton and q.is_cuda:
            out = kernel.decode_attention(q[:, :, 0].contiguous(), k_cache, v_cache, self.lengths)
        else:
            out = decode_attention_torch(q[:, :, 0], k_cache, v_cache, self.lengths, self.limit)
        return out[:, :, None]
