"""Attention over the paged KV cache, one context per forward: prefill (packed tokens of several
sequences, each a chunk starting at some position, and maybe a tail of decoding rows) and decode
(one new token per row).

Prefill writes each token's K/V into its slot first, then attends per sequence: a chunk that
starts at position 0 attends to its own keys (SDPA, causal); one that continues a sequence (a
later chunk, or a prompt whose head was found in the prefix cache) gathers the sequence's K/V from
its blocks and attends with the causal mask aligned to its end. The decode tail (one token per
row, riding in the same forward when the engine runs mixed steps) attends in one paged decode call
for all its rows, its K/V already written with the chunks'. FlashInfer's paged prefill does all of
it in one call per layer when asked for (fp8route.engine.flashinfer_attention).

Decode runs the split-KV Triton kernel on CUDA (fp8route.engine.paged_decode), which also rotates
and writes the new key; elsewhere (and as its reference) SDPA over each row's gathered positions.

With an fp8 pool (kv_cache_dtype "fp8") every write quantizes and every read of the cache
dequantizes: the decode kernel inside itself, gather_rows after gathering. A fresh chunk (one that
starts its sequence) attends to its own K/V as computed, not as cached (as vLLM's V0 prefill did;
its V1 FlashAttention reads the chunk back from the cache): only what a later chunk or a decode
step reads back has gone through e4m3.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from fp8route.engine import paged_decode as kernel
from fp8route.engine.kv_pool import KVPool, upload
from fp8route.models.fused import rope, rope_into_cache

if TYPE_CHECKING:
    from fp8route.engine.flashinfer_attention import FlashInferAttention


@functools.cache
def triton_decode_available() -> bool:
    return kernel.TRITON_IMPORT_ERROR is None and torch.cuda.is_available()


def decode_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The reference: q [B, H, D] over the first lengths[b] positions of k/v [B, Hkv, S, D]."""
    visible = torch.arange(k.shape[2], device=q.device)[None, :] < lengths[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=visible[:, None, None, :], enable_gqa=True)
    return out[:, :, 0]


def gather_rows(pool: KVPool, layer: int, rows: torch.Tensor | int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `blocks` blocks of each table row's K and V (rows [B] on the device, or one row
    number, read without a host-to-device copy), as [B, Hkv, blocks * BS, D]."""
    k, v = pool.layer(layer)
    index = pool.tables[rows, :blocks].long()
    shape = (index.shape[0] if index.dim() == 2 else 1, -1, *k.shape[2:])
    return pool.dequantize(layer, k[index].reshape(shape).transpose(1, 2), v[index].reshape(shape).transpose(1, 2))


def paged_decode_attention(
    pool: KVPool,
    layer: int,
    q: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    limit: int | None,
    triton: bool,
) -> torch.Tensor:
    """q [B, H, D] (after RoPE; unit stride on D) of table rows [B] over each row's first lengths[b]
    positions, already in the cache -> [B, H, D]: the Triton kernel, or the torch reference, which
    gathers the first blocks covering limit (a host bound on lengths; None: the whole table)."""
    if triton:
        k_blocks, v_blocks = pool.layer(layer)
        return kernel.decode_attention(
            q, kernel.Pages(k_blocks, v_blocks, pool.tables, rows, *pool.layer_scales(layer)), lengths
        )
    blocks = pool.max_blocks_per_seq
    if limit is not None:
        blocks = min(blocks, -(-limit // pool.block_size))
    k_rows, v_rows = gather_rows(pool, layer, rows, blocks)
    return decode_attention_torch(q, k_rows, v_rows, lengths)


@dataclass(frozen=True)
class DecodeTail:
    """Decoding rows at the end of a packed prefill: tokens [offset, N) of the batch, one per table
    row rows[i] (device), each attending to its first lengths[i] positions (device; limit bounds
    them on the host). triton: the paged decode kernel, else the torch reference."""

    offset: int
    rows: torch.Tensor
    lengths: torch.Tensor
    limit: int
    triton: bool


@dataclass(frozen=True)
class PrefillSeq:
    """One sequence's chunk in a packed prefill: tokens [offset, offset + length) of the batch,
    at positions start .. start + length - 1, its blocks in table row `row`."""

    offset: int
    length: int
    start: int
    row: int


# SDPA on CUDA picks cuDNN's attention, the fastest here, which builds a plan for each new sequence
# length: ~1.4 ms of host time a call, per layer and sequence, more than the GPU work of a serving
# step's chunks (benchmarks/results/h200/serve/). Lengths padded to a multiple of this reuse a few plans.
_LENGTH_CLASS = 128


def _causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA of one chunk over its own keys, [1, H, T, D]; on CUDA with T padded to a length
    class (the padding comes after every real token, so no real query sees it)."""
    t = q.shape[2]
    pad = -t % _LENGTH_CLASS if q.is_cuda else 0
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return out[:, :, :t] if pad else out


@dataclass(frozen=True)
class _Continuations:
    """Chunks that continue their sequences with the same length and the same end: one attention call
    for all of them (prompts behind a shared cached prefix come this way, many to a step)."""

    length: int
    end: int
    rows: torch.Tensor  # [G] table rows, on the device
    tokens: torch.Tensor  # [G * length] their tokens' places in the packed batch, on the device


class PrefillAttention:
    def __init__(
        self,
        pool: KVPool,
        seqs: list[PrefillSeq],
        slots: torch.Tensor,
        flashinfer: FlashInferAttention | None = None,
        tail: DecodeTail | None = None,
    ) -> None:
        """seqs: the chunks; slots: every token's slot, the tail's included. With FlashInfer the tail's
        rows are planned as one-token sequences (by the caller) and attend in its one prefill call."""
        self.pool, self.seqs, self.slots, self.flashinfer, self.tail = pool, seqs, slots, flashinfer, tail
        self.fresh = [seq for seq in seqs if seq.start == 0]
        groups: dict[tuple[int, int], list[PrefillSeq]] = {}
        for seq in seqs:
            if seq.start:
                groups.setdefault((seq.length, seq.start + seq.length), []).append(seq)
        device = slots.device
        self.continuations = [
            _Continuations(
                length,
                end,
                upload(torch.tensor([seq.row for seq in members]), device),
                upload(torch.tensor([seq.offset + i for seq in members for i in range(length)]), device),
            )  # fmt: skip
            for (length, end), members in groups.items()
        ]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """q [1, N, H, D], k and v [1, N, Hkv, D] (the packed tokens), cos/sin [1, N, D] -> [1, H, N, D]."""
        k = rope(k, cos, sin, token_major=True)  # [1, Hkv, N, D] over [1, N, Hkv, D] storage
        self.pool.store(layer, self.slots, k[0].transpose(0, 1), v[0])
        if self.flashinfer is not None:
            return self.flashinfer.prefill(layer, rope(q, cos, sin, token_major=True))
        q = rope(q, cos, sin)
        v = v.transpose(1, 2)
        if len(self.fresh) == len(self.seqs) == 1 and self.tail is None:
            return _causal_self_attention(q, k, v)
        out = torch.empty_like(q)
        for seq in self.fresh:
            part = slice(seq.offset, seq.offset + seq.length)
            out[:, :, part] = _causal_self_attention(q[:, :, part], k[:, :, part], v[:, :, part])
        for group in self.continuations:
            k_i, v_i = gather_rows(self.pool, layer, group.rows, -(-group.end // self.pool.block_size))
            q_i = q[0][:, group.tokens].unflatten(1, (-1, group.length)).transpose(0, 1)  # [G, H, length, D]
            mask = causal_lower_right(group.length, group.end)
            o = F.scaled_dot_product_attention(
                q_i, k_i[:, :, : group.end], v_i[:, :, : group.end], attn_mask=mask, enable_gqa=True
            )
            out[0].index_copy_(1, group.tokens, o.transpose(0, 1).flatten(1, 2))
        if self.tail is not None:
            tail = self.tail
            q_tail = q[0, :, tail.offset :].transpose(0, 1)  # [T, H, D], unit stride on D
            o = paged_decode_attention(self.pool, layer, q_tail, tail.rows, tail.lengths, tail.limit, tail.triton)
            out[0, :, tail.offset :] = o.transpose(0, 1)
        return out


class DecodeAttention:
    """One new token per row: row b writes its K/V at positions[b] of table row rows[b] and attends
    to positions 0..positions[b]. positions and rows are device tensors; limit, when given, is a
    host bound on positions + 1 that lets the torch path gather less (a captured step passes none).
    With a FlashInfer attention (planned for this step by the caller), FlashInfer's decode runs."""

    def __init__(
        self,
        pool: KVPool,
        positions: torch.Tensor,
        rows: torch.Tensor,
        limit: int | None = None,
        use_triton: bool | None = None,
        flashinfer: FlashInferAttention | None = None,
    ) -> None:
        self.pool, self.positions, self.rows, self.limit, self.flashinfer = pool, positions, rows, limit, flashinfer
        self.lengths = positions + 1
        self.use_triton = triton_decode_available() if use_triton is None else use_triton
        self.fuse_new_token: bool | None = None
        self._slots: torch.Tensor | None = None

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """q [B, 1, H, D], k and v [B, 1, Hkv, D], cos/sin [B, 1, D] -> [B, H, 1, D]."""
        triton = self.flashinfer is None and self.use_triton and q.is_cuda
        if triton:
            k_blocks, v_blocks = self.pool.layer(layer)
            pages = kernel.Pages(k_blocks, v_blocks, self.pool.tables, self.rows, *self.pool.layer_scales(layer))
            new = kernel.NewToken(k[:, 0], v[:, 0], cos[:, 0], sin[:, 0])
            if self.fuse_new_token is None:  # every layer alike: decided at the first
                self.fuse_new_token = kernel.fuses_new_token(q[:, 0], new)
            if self.fuse_new_token:  # RoPE and the cache write inside the attention kernel
                return kernel.decode_attention(q[:, 0], pages, self.lengths, new=new)[:, :, None]
        if self._slots is None:
            self._slots = self.pool.slots(self.rows, self.positions)
        k_flat, v_flat = self.pool.flat(layer)
        scales = self.pool.layer_scales(layer) if self.pool.quantized else None
        rope_into_cache(k, v, cos, sin, k_flat, v_flat, self._slots, scales)
        q = rope(q, cos, sin)[:, :, 0]
        if self.flashinfer is not None:
            out = self.flashinfer.decode(layer, q)
        else:
            out = paged_decode_attention(self.pool, layer, q.contiguous(), self.rows, self.lengths, self.limit, triton)
        return out[:, :, None]
