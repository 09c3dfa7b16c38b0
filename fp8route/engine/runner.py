"""ModelRunner: a Llama-family model over a paged KV pool. It runs two kinds of forward:

- prefill: packed tokens of several sequences, each a chunk at its own positions, eager; its
  K/V go into the sequences' blocks and only the logits asked for (each sequence's last token,
  where its prompt ends) reach lm_head. Decoding rows may ride at its end, one token each
  (`DecodeRows`): a step with both prefill chunks and decodes is then one forward, its weights
  read once; every decode row reaches lm_head;
- decode: one token per row, from a CUDA graph per batch bucket on a GPU.

Who owns which blocks and table rows is the caller's business (the scheduler, or the static
generate); the runner only reads and writes what the tables say.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from fp8route.engine.argmax import greedy_tokens
from fp8route.engine.attention import (
    DecodeAttention,
    DecodeTail,
    PrefillAttention,
    PrefillSeq,
    paged_decode_attention,
    triton_decode_available,
)
from fp8route.engine.decode_graphs import DecodeGraphs
from fp8route.engine.flashinfer_attention import FlashInferAttention, check_attention
from fp8route.engine.kv_pool import KVPool, upload
from fp8route.engine.paged_decode import split_len
from fp8route.engine.prefill_graphs import MAX_TOKENS, PrefillGraphs, why_not_graphed
from fp8route.errors import Fp8InputError
from fp8route.models.llama import LlamaForCausalLM, rope_tables


class DecodeRows(NamedTuple):
    """Decoding sequences for a packed prefill to carry, one token each: row i computes tokens[i]
    at position positions[i] of table row rows[i], whose blocks are blocks[i]."""

    tokens: Sequence[int]
    positions: Sequence[int]
    rows: Sequence[int]
    blocks: Sequence[Sequence[int]]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        *,
        dtype: torch.dtype,
        use_cuda_graphs: bool = True,
        attention: str = "builtin",
    ) -> None:
        check_attention(attention, pool.device)
        self.model, self.dtype = model, dtype
        self.use_cuda_graphs = use_cuda_graphs
        self.use_triton: bool | None = None  # decode attention: None = Triton on CUDA when it imports
        self.attention = attention
        # The prefill's pieces between attentions, from CUDA graphs (fp8route.engine.prefill_graphs),
        # when use_cuda_graphs and use_prefill_graphs are both set.
        self.use_prefill_graphs = True
        self.prefill_graphs: PrefillGraphs | None = None
        # Computed once for every position the cache can hold, then indexed: the same values
        # rope_tables gives for any positions, without per-step host work.
        self.rope_cos, self.rope_sin = rope_tables(model.cfg, torch.arange(pool.max_seq_len, device=pool.device))
        self.pool: KVPool = pool
        self.set_pool(pool)

    def set_pool(self, pool: KVPool | None) -> None:
        """Run over another pool (before serving: the engine sizes the real one after a profile run;
        None lets the old one go first). The decode graphs captured the old pool's addresses, so they go."""
        self.graphs: DecodeGraphs | None = None
        self.flashinfer: FlashInferAttention | None = None
        if pool is None:
            del self.pool
            return
        self.pool = pool
        if self.attention == "flashinfer":
            self.flashinfer = FlashInferAttention(pool, self.model.cfg.num_attention_heads, self.dtype, pool.device)

    @property
    def plans_on_host(self) -> bool:
        """Whether decode needs each row's host lengths and blocks (FlashInfer plans from them)."""
        return self.flashinfer is not None

    def prefill(
        self,
        tokens: Sequence[Sequence[int]],
        starts: Sequence[int],
        rows: Sequence[int],
        blocks: Sequence[Sequence[int]],
        wanted: Sequence[int],
        decodes: DecodeRows | None = None,
    ) -> torch.Tensor:
        """One packed forward: sequence i computes tokens[i] at positions starts[i].., its K/V going
        into blocks[i] (table row rows[i], already holding those blocks); the decode rows, when
        given, ride after the chunks. Returns the logits of the last token of each sequence listed
        in wanted, then of each decode row: [len(wanted) + len(decodes.tokens), vocab]."""
        lengths = [len(t) for t in tokens]
        if not lengths or min(lengths) < 1:
            raise Fp8InputError("prefill: every sequence needs at least one token")
        tail = decodes or DecodeRows([], [], [], [])
        page = self.pool.block_size
        offsets = np.cumsum([0, *lengths])
        chunked = int(offsets[-1])  # the chunks' tokens; the tail's come after them
        at = np.asarray(tail.positions, dtype=np.int64)
        positions = np.concatenate([*(np.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)), at])
        tail_blocks = np.asarray([b[p // page] for b, p in zip(tail.blocks, tail.positions, strict=True)], np.int64)
        slots = np.concatenate(
            [
                *(
                    np.asarray(b, dtype=np.int64)[pos // page] * page + pos % page
                    for b, pos in zip(blocks, np.split(positions[:chunked], offsets[1:-1]), strict=True)
                ),
                tail_blocks * page + at % page,
            ]
        )
        ids = np.asarray([*(t for seq in tokens for t in seq), *tail.tokens], dtype=np.int64)
        total = len(ids)
        logit_rows = np.concatenate([offsets[1:][np.asarray(wanted, dtype=np.int64)] - 1, np.arange(chunked, total)])
        # One copy to the device: ids, positions, slots, the rows lm_head takes, the tail's table rows.
        token_ids, pos, slot, outputs, tail_rows = _upload_parts(
            [ids, positions, slots, logit_rows, np.asarray(tail.rows, dtype=np.int64)], self.pool.device
        )
        seqs = [PrefillSeq(int(o), n, s, r) for o, n, s, r in zip(offsets, lengths, starts, rows, strict=False)]
        decoding = None
        if len(at):
            limit = int(at.max()) + 1
            decoding = DecodeTail(chunked, tail_rows, pos[chunked:] + 1, limit, self._triton_tail())
        if self.flashinfer is not None:  # the decode rows as one-token sequences of the same call
            ends = [s + n for s, n in zip(starts, lengths, strict=True)] + [p + 1 for p in tail.positions]
            self.flashinfer.plan_prefill([*lengths, *[1] * len(at)], ends, [*blocks, *tail.blocks])
        h = self.model.model.embed_tokens(token_ids)[None].to(self.dtype)
        cos, sin = self.rope_cos[pos][None], self.rope_sin[pos][None]
        context = PrefillAttention(self.pool, seqs, slot, self.flashinfer, decoding)
        graphs = self.prefill_graphs_for(total)
        if graphs is not None:
            normed = graphs.run(h[0], cos, sin, context)[None]
        else:
            normed = self.model.model.run_layers(h, cos, sin, context)
        return self.model.lm_head(normed[0, outputs])

    def prefill_graphs_for(self, tokens: int) -> PrefillGraphs | None:
        """The prefill graphs for a forward of this many tokens, made on first use: on CUDA with
        use_cuda_graphs, builtin attention and no tensor parallelism (None: run eagerly)."""
        if not (self.use_cuda_graphs and self.use_prefill_graphs):
            return None
        graphs = self.prefill_graphs
        if graphs is None and self.pool.device.type == "cuda" and self.why_prefill_eager() is None:
            most = min(MAX_TOKENS, getattr(self.model, "max_prefill_tokens", MAX_TOKENS))
            graphs = self.prefill_graphs = PrefillGraphs(self.model.model, most, self.pool.device, self.dtype)
        return graphs if graphs is not None and tokens <= graphs.max_tokens else None

    def why_prefill_eager(self) -> str | None:
        """Why this model's prefill on CUDA cannot run from the prefill graphs (None: it can)."""
        if self.flashinfer is not None:
            return "FlashInfer's prefill plans its own call per forward"
        return why_not_graphed(self.model.model)

    def warm_decode_tail(self) -> int:
        """Compile now, not in the middle of serving, the decode kernel's variants a mixed step's tail
        can take: one per split length (paged_decode.split_len) over 1..max_rows rows. Returns how
        many calls it made (0 where the tail does not run the Triton kernel)."""
        if not self._triton_tail():
            return 0
        pool, cfg = self.pool, self.model.cfg
        heads, size = cfg.num_attention_heads, cfg.head_size
        seen: set[int] = set()
        for rows in range(1, pool.max_rows + 1):
            split = split_len(rows * cfg.num_key_value_heads)
            if split in seen:
                continue
            seen.add(split)
            q = torch.zeros((rows, heads, size), dtype=self.dtype, device=pool.device)
            pad = torch.full((rows,), pool.pad_row, dtype=torch.int64, device=pool.device)
            paged_decode_attention(pool, 0, q, pad, torch.ones_like(pad), 1, True)
        return len(seen)

    def _triton_tail(self) -> bool:
        """Whether a prefill's decode tail runs the Triton kernel: use_triton when set (True on a CPU
        needs Triton's interpreter, TRITON_INTERPRET=1), else on CUDA when Triton imports."""
        if self.use_triton is not None:
            return self.use_triton
        return self.pool.device.type == "cuda" and triton_decode_available()

    def decode_step(
        self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, limit: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row: tokens [B] at positions [B] of table rows [B] (device) -> (logits
        [B, vocab], argmax [B]). Reads its inputs only from device tensors and never syncs the host,
        so a CUDA graph can capture it. limit (a host bound on positions + 1) narrows the eager torch
        attention's read; a captured step passes None."""
        h = self.model.model.embed_tokens(tokens)[:, None].to(self.dtype)
        cos = self.rope_cos[positions][:, None]  # [B, 1, D]: each row at its own position
        sin = self.rope_sin[positions][:, None]
        context = DecodeAttention(self.pool, positions, rows, limit, self.use_triton, self.flashinfer)
        logits = self.model.lm_head(self.model.model.run_layers(h, cos, sin, context)[:, 0])
        return logits, greedy_tokens(logits)

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        *,
        limit: int | None = None,
        host_lengths: Sequence[int] | None = None,
        host_blocks: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """decode_step, replayed from a CUDA graph when on CUDA and use_cuda_graphs is set.
        host_lengths (positions + 1) and host_blocks (each row's blocks) are what FlashInfer plans from."""
        graphs = None
        if self.use_cuda_graphs and tokens.is_cuda:
            if self.graphs is None:
                self.graphs = DecodeGraphs(self.decode_step, self.pool.max_rows, self.pool.pad_row, tokens.device)
            graphs = self.graphs
        if self.flashinfer is not None:
            if host_lengths is None or host_blocks is None:
                raise Fp8InputError("attention='flashinfer' plans each decode step from host lengths and blocks")
            size = graphs.bucket(len(tokens)) if graphs is not None else len(tokens)
            self.flashinfer.plan_decode(size, host_lengths, host_blocks)
        if graphs is not None:
            return graphs.run(tokens, positions, rows)
        return self.decode_step(tokens, positions, rows, limit)


def _upload_parts(parts: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 arrays to the device in one copy, each part's view starting 16 bytes aligned: Triton
    compiles a kernel apart for a pointer that is not, which a warm-up would not have met."""
    sizes = [len(part) for part in parts]
    starts = np.cumsum([0, *(n + n % 2 for n in sizes)])
    host = np.zeros(int(starts[-1]), dtype=np.int64)
    for part, start in zip(parts, starts, strict=False):
        host[start : start + len(part)] = part
    packed = upload(torch.from_numpy(host), device)
    return [packed[start : start + n] for start, n in zip(starts, sizes, strict=False)]
