"""Attention over the paged KV cache, one context per forward.

StepAttention serves a step's flat batch: decode rows (one token each) and prefill chunks, fresh or
continuing a cached prefix, of any number of sequences. Each layer writes every token's rotated key
and its value into the token's slot (one kernel), then attends in one call over all rows, reading
K/V through the block tables: fp8route's paged attention kernel (fp8route.kernels.paged_attention)
on CUDA, its torch path elsewhere, or FlashInfer's paged prefill when asked for. The step's fresh
chunks (prompts' first, led by nothing cached), when the runner sends them so, attend over their own
K/V instead (SDPA a chunk at a time: cuDNN's kernel on a GPU) and the paged kernel serves the rest.
With an fp8 pool a fresh chunk attends to its own K/V as cached (rounded to e4m3), as every later
step does (vLLM V1 does the same), on either path.

DecodeAttention serves a decode step replayed from a CUDA graph: the split-KV decode kernel
(fp8route.kernels.paged_decode), which also rotates and writes the new key, tuned for a whole batch of
decode rows; elsewhere SDPA over each row's gathered positions.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fp8route.engine.kv_pool import KVPool
from fp8route.kernels import paged_decode as kernel
from fp8route.kernels.fused import rope, rope_into_cache
from fp8route.kernels.paged_attention import (
    PagedKV,
    Sequences,
    paged_attention,
    paged_attention_reference,
    paged_attention_rows,
)

if TYPE_CHECKING:
    from fp8route.engine.flashinfer_attention import FlashInferAttention


@functools.cache
def triton_decode_available() -> bool:
    return kernel.TRITON_IMPORT_ERROR is None and torch.cuda.is_available()


def fixed_split_rows(
    q: torch.Tensor, new: kernel.NewToken, pool: KVPool, layer: int, rows: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor | None:
    """The deterministic mode's decode rows, in decode and mixed steps alike: q [B, H, D] before RoPE
    and the rows' new tokens through the decode kernel at its fixed split, RoPE and the cache write
    inside it -> [B, H, D]; None where the kernel cannot fuse them (then both kinds of step rotate and
    write first). Both step kinds take the same path for a model (the test is its head size alone, the
    operands made unit-stride; decode_attention checks the rest), so a decode row's stored key and its
    output are the same bits in either."""
    d = q.shape[-1]
    if d < 16 or d & (d - 1):  # what fuses_new_token asks of a head beyond unit strides and shapes
        return None
    q, new = q.contiguous(), kernel.NewToken(*(t.contiguous() for t in new))
    k_blocks, v_blocks = pool.layer(layer)
    pages = kernel.Pages(k_blocks, v_blocks, pool.tables, rows, *pool.layer_scales(layer))
    return kernel.decode_attention(q, pages, lengths, split=kernel.FIXED_SPLIT, new=new)


def decode_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The reference: q [B, H, D] over the first lengths[b] positions of k/v [B, Hkv, S, D]."""
    visible = torch.arange(k.shape[2], device=q.device)[None, :] < lengths[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=visible[:, None, None, :], enable_gqa=True)
    return out[:, :, 0]


def decode_attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """decode_attention_torch with each row alone over exactly its lengths[b] positions: the same
    arithmetic whatever else is in the batch (the deterministic mode's; reads lengths on the host)."""
    rows = [
        F.scaled_dot_product_attention(q[b, :, None][None], k[b : b + 1, :, :n], v[b : b + 1, :, :n], enable_gqa=True)
        for b, n in enumerate(lengths.tolist())
    ]
    return torch.cat(rows)[:, :, 0]


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
    alone: bool = False,
) -> torch.Tensor:
    """q [B, H, D] (after RoPE; unit stride on D) of table rows [B] over each row's first lengths[b]
    positions, already in the cache -> [B, H, D]: the Triton kernel, or the torch reference, which
    gathers the first blocks covering limit (a host bound on lengths; None: the whole table); alone:
    the torch path row by row (decode_attention_rows)."""
    if triton:
        k_blocks, v_blocks = pool.layer(layer)
        return kernel.decode_attention(
            q, kernel.Pages(k_blocks, v_blocks, pool.tables, rows, *pool.layer_scales(layer)), lengths
        )
    blocks = pool.max_blocks_per_seq
    if limit is not None:
        blocks = min(blocks, -(-limit // pool.block_size))
    k_rows, v_rows = gather_rows(pool, layer, rows, blocks)
    return (decode_attention_rows if alone else decode_attention_torch)(q, k_rows, v_rows, lengths)


@dataclass(frozen=True)
class FreshChunks:
    """A step's last pieces from piece `first` on, each a fresh chunk (its prompt's first, from position
    0, more than one token); bounds: their token offsets in the step (host), the end last."""

    first: int
    bounds: tuple[int, ...]


# SDPA on CUDA picks cuDNN's attention, which plans once per sequence length (tens of ms of host time
# each): there a chunk is read as one of a few lengths, multiples of this, reaching into the rows after it.
LENGTH_CLASS = 128


def fresh_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Sequence[int], out: torch.Tensor, length_class: int = 1
) -> torch.Tensor:
    """q [R, H, D], k and v [R, Hkv, D] (token-major, unit stride on D), out [T, H, D]: chunk i, tokens
    bounds[i] .. bounds[i + 1] - 1, attending causally over its own tokens by SDPA, into out's rows -> out.
    Each chunk is read padded to a multiple of length_class with the rows after it (R >= bounds[-1] +
    length_class - 1; K/V finite there): causal, so no real query sees them, and the padded queries' rows
    are dropped."""
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        end = a + -(-(b - a) // length_class) * length_class
        q_i, k_i, v_i = (x[a:end].transpose(0, 1)[None] for x in (q, k, v))  # [1, heads, n, D]
        o = F.scaled_dot_product_attention(q_i, k_i, v_i, is_causal=True, enable_gqa=True)
        out[a:b] = o[0, :, : b - a].transpose(0, 1)
    return out


def _slack(device: torch.device) -> int:
    """Rows fresh_attention reads past the last chunk: a length class's padding on CUDA, none elsewhere."""
    return LENGTH_CLASS - 1 if device.type == "cuda" else 0


def _into(heads: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """An attention's output [T, H, D], written into out where given (and not already there), as
    [1, H, T, D]."""
    if out is not None and heads is not out:
        heads = out.copy_(heads)
    return heads.transpose(0, 1)[None]


class StepAttention:
    """A step's tokens [T]: each written at slots[t], each sequence of `seqs` attending causally over
    its cached positions. triton: the paged attention kernel (on a CPU: under Triton's interpreter),
    else its torch path. With FlashInfer (planned for this step by the caller) its paged prefill runs.
    fresh: the step's last sequences, fresh chunks, attend over their own K/V (rounded as an fp8 cache
    gives them back) by SDPA a chunk at a time (fresh_attention), the other sequences through the paged
    kernel. alone: for the deterministic mode, without triton each query by itself through the torch
    path (paged_attention_rows); with it the paged kernel, whose rows depend on their own sequence
    only, its decode rows through the decode kernel at its fixed split as in a decode step (the
    scheduler sends a prompt's one-token piece through the multi-query grid). counts: the step's
    [one-query sequences, sequences] on the device, for a captured step (PrefillGraphs) to copy."""

    def __init__(
        self,
        pool: KVPool,
        slots: torch.Tensor,
        seqs: Sequences,
        triton: bool,
        flashinfer: FlashInferAttention | None = None,
        fresh: FreshChunks | None = None,
        alone: bool = False,
        counts: torch.Tensor | None = None,
    ) -> None:
        self.pool, self.slots, self.seqs, self.triton, self.flashinfer = pool, slots, seqs, triton, flashinfer
        self.fresh = fresh if flashinfer is None and not alone else None
        self.alone, self.counts = alone, counts

    @property
    def graphable(self) -> bool:
        """Whether a captured step can run this attention: the paged kernel over the step's counts read on
        the device (not the fresh chunks' own call, FlashInfer's planned one, or the deterministic mode's
        host split)."""
        paged = self.flashinfer is None and self.fresh is None and not self.alone
        return self.triton and paged and self.counts is not None

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [1, T, H, D], k and v [1, T, Hkv, D], cos/sin [1, T, D] -> [1, H, T, D]. out [T, H, D]: where
        the output goes (the paged kernel leaves rows of no sequence untouched there), else new."""
        pool = self.pool
        if self.flashinfer is not None:
            pool.store(layer, self.slots, rope(k, cos, sin, token_major=True)[0].transpose(0, 1), v[0])
            heads = self.flashinfer.prefill(layer, rope(q, cos, sin, token_major=True))[0].transpose(0, 1)
            return _into(heads, out)
        k_flat, v_flat = pool.flat(layer)
        scales = pool.layer_scales(layer) if pool.quantized else None
        # The fresh chunks' K/V as the cache gives them back, from the same kernel, with fresh_attention's
        # slack rows (zero) after them.
        staged = self._staged(k) if self.fresh is not None else None
        rope_into_cache(
            k[0][:, None], v[0][:, None], cos[0][:, None], sin[0][:, None], k_flat, v_flat, self.slots, scales,
            None if staged is None else (staged[0, : k.shape[1]], staged[1, : k.shape[1]]),
        )  # fmt: skip
        k_blocks, v_blocks = pool.layer(layer)
        cache = PagedKV(k_blocks, v_blocks, pool.tables, *pool.layer_scales(layer))
        if staged is not None:
            return _into(self._with_fresh(q, staged, cos, sin, cache, out), out)
        raw = q[0]  # [T, H, D] before RoPE: the deterministic decode rows rotate inside the decode kernel
        q = rope(q, cos, sin, token_major=True)[0].transpose(0, 1)  # [T, H, D]
        if self.alone and not self.triton:
            return _into(paged_attention_rows(q, cache, self.seqs), out)
        if self.alone:  # decode rows as a decode step runs them
            return _into(self._alone(layer, raw, q, k, v, cos, sin, cache), out)
        attend = paged_attention if self.triton else paged_attention_reference
        return _into(attend(q, cache, self.seqs, out=out), out)

    def _staged(self, k: torch.Tensor) -> torch.Tensor:
        """[2, T + slack, Hkv, D] for the step's K and V as cached, the slack rows (fresh_attention reads
        the last chunk padded into them) zero."""
        _, t, hkv, d = k.shape
        staged = k.new_empty(2, t + _slack(k.device), hkv, d)
        staged[:, t:].zero_()
        return staged

    def _with_fresh(
        self, q: torch.Tensor, staged: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PagedKV,
        out: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """q [1, T, H, D] before RoPE, staged the step's K/V as cached (_staged): the fresh chunks over
        their own K/V, then the other sequences through the paged kernel, into out (else new) ->
        [T, H, D]. q is rotated into a buffer with fresh_attention's slack rows after it."""
        fresh = self.fresh
        assert fresh is not None
        _, t, h, d = q.shape
        a = fresh.bounds[0]  # the fresh chunks' first token
        rotated = q.new_empty(t + _slack(q.device), h, d)
        rope(q, cos, sin, out=rotated[:t].transpose(0, 1)[None])
        out = torch.empty((t, h, d), dtype=q.dtype, device=q.device) if out is None else out
        bounds = [b - a for b in fresh.bounds]
        fresh_attention(rotated[a:], staged[0, a:], staged[1, a:], bounds, out[a:], _slack(q.device) + 1)
        if fresh.first:
            seqs = self.seqs
            rest = Sequences(seqs.cu_q[: fresh.first + 1], seqs.lengths[: fresh.first], seqs.rows[: fresh.first],
                             min(seqs.singles, fresh.first))  # fmt: skip
            attend = paged_attention if self.triton else paged_attention_reference
            attend(rotated[:a], cache, rest, out=out[:a])
        return out

    def _alone(
        self, layer: int, raw: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, cache: PagedKV,
    ) -> torch.Tensor:  # fmt: skip
        """The deterministic mode's step on the Triton kernels: decode rows through the decode kernel at its
        fixed split (fixed_split_rows; their keys, written above too, written again by it), the
        rest through the paged kernel's multi-query grid."""
        seqs, singles = self.seqs, self.seqs.singles
        if not singles:
            return paged_attention(q, cache, seqs)
        new = kernel.NewToken(k[0, :singles], v[0, :singles], cos[0, :singles], sin[0, :singles])
        rows = fixed_split_rows(raw[:singles], new, self.pool, layer, seqs.rows[:singles], seqs.lengths[:singles])
        if rows is None:
            return paged_attention(q, cache, seqs, decode_split=kernel.FIXED_SPLIT)
        out = torch.empty_like(q)
        out[:singles] = rows
        if seqs.count > singles:
            rest = Sequences(seqs.cu_q[singles:], seqs.lengths[singles:], seqs.rows[singles:], 0)
            paged_attention(q, cache, rest, out=out)
        return out


class DecodeAttention:
    """One new token per row: row b writes its K/V at positions[b] of table row rows[b] and attends
    to positions 0..positions[b]. positions and rows are device tensors; limit, when given, is a
    host bound on positions + 1 that lets the torch path gather less (a captured step passes none).
    With a FlashInfer attention (planned for this step by the caller), FlashInfer's decode runs.
    alone: for the deterministic mode, without the Triton kernels each row by itself through the torch
    path (decode_attention_rows); with them the decode kernel at a fixed split (paged_decode.FIXED_SPLIT:
    a row's splits from its own length, its programs from the batch), RoPE and the cache write before
    it: the path a decode row takes in a mixed step too."""

    def __init__(
        self,
        pool: KVPool,
        positions: torch.Tensor,
        rows: torch.Tensor,
        limit: int | None = None,
        use_triton: bool | None = None,
        flashinfer: FlashInferAttention | None = None,
        alone: bool = False,
    ) -> None:
        self.pool, self.positions, self.rows, self.limit, self.flashinfer = pool, positions, rows, limit, flashinfer
        self.lengths = positions + 1
        self.use_triton = not alone and (triton_decode_available() if use_triton is None else use_triton)
        grid = (positions.is_cuda and triton_decode_available()) if use_triton is None else use_triton
        self.alone, self.one_query_grid = alone and not grid, alone and grid
        self.fuse_new_token: bool | None = None
        self._slots: torch.Tensor | None = None
        self._seqs: Sequences | None = None  # the rows as one-query sequences (the deterministic mode's)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """q [B, 1, H, D], k and v [B, 1, Hkv, D], cos/sin [B, 1, D] -> [B, H, 1, D]."""
        if self.one_query_grid:
            return self._one_query_grid(layer, q, k, v, cos, sin)
        triton = self.flashinfer is None and self.use_triton and q.is_cuda
        if triton:
            k_blocks, v_blocks = self.pool.layer(layer)
            pages = kernel.Pages(k_blocks, v_blocks, self.pool.tables, self.rows, *self.pool.layer_scales(layer))
            new = kernel.NewToken(k[:, 0], v[:, 0], cos[:, 0], sin[:, 0])
            if self.fuse_new_token is None:  # every layer alike: decided at the first
                self.fuse_new_token = kernel.fuses_new_token(q[:, 0], new)
            if self.fuse_new_token:  # RoPE and the cache write inside the attention kernel
                return kernel.decode_attention(q[:, 0], pages, self.lengths, new=new)[:, :, None]
        self._write_new_token(layer, k, v, cos, sin)
        q = rope(q, cos, sin)[:, :, 0]
        if self.flashinfer is not None:
            out = self.flashinfer.decode(layer, q)
        else:
            out = paged_decode_attention(
                self.pool, layer, q.contiguous(), self.rows, self.lengths, self.limit, triton, self.alone
            )
        return out[:, :, None]

    def _one_query_grid(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        new = kernel.NewToken(k[:, 0], v[:, 0], cos[:, 0], sin[:, 0])
        out = fixed_split_rows(q[:, 0], new, self.pool, layer, self.rows, self.lengths)
        if out is not None:
            return out[:, :, None]
        self._write_new_token(layer, k, v, cos, sin)
        q = rope(q, cos, sin)[:, :, 0].contiguous()  # [B, H, D]
        if self._seqs is None:
            count = q.shape[0]
            cu_q = torch.arange(count + 1, dtype=torch.int32, device=q.device)
            self._seqs = Sequences(cu_q, self.lengths.to(torch.int32), self.rows.to(torch.int32), count)
        k_blocks, v_blocks = self.pool.layer(layer)
        cache = PagedKV(k_blocks, v_blocks, self.pool.tables, *self.pool.layer_scales(layer))
        return paged_attention(q, cache, self._seqs, decode_split=kernel.FIXED_SPLIT)[:, :, None]

    def _write_new_token(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """The rows' new keys (after RoPE) and values into the cache at their positions."""
        if self._slots is None:
            self._slots = self.pool.slots(self.rows, self.positions)
        k_flat, v_flat = self.pool.flat(layer)
        scales = self.pool.layer_scales(layer) if self.pool.quantized else None
        rope_into_cache(k, v, cos, sin, k_flat, v_flat, self._slots, scales)
