"""CausalLM: the Llama-family model plus what running it needs: a static KV cache, RoPE tables for
every position, an eager prefill and a one-token decode step that a CUDA graph can capture.

The step (embedding, every layer, final norm, lm_head, greedy argmax) reads its inputs only from
device tensors and never syncs the host, so the same function runs eager on CPU (where the tests
exercise it) and captured on CUDA (fp8route.models.decode_graphs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from fp8route.errors import Fp8InputError
from fp8route.models.attention import DecodeAttention, PrefillAttention
from fp8route.models.flashinfer_attention import FlashInferAttention, check_attention
from fp8route.models.kv_cache import KVCache
from fp8route.models.llama import LlamaConfig, LlamaForCausalLM, rope_tables
from fp8route.models.token_ids import check_token_ids

if TYPE_CHECKING:
    from fp8route.models.decode_graphs import DecodeGraphs
    from fp8route.models.generate import Generation


class CausalLM(LlamaForCausalLM):
    """A Llama-family model ready to generate: `model(ids)` is the full forward (for evaluation),
    `model.generate(ids, n)` runs prefill + cached decode.

    The KV cache (2 x layers x max_batch_size x kv_heads x max_seq_len x head_dim in dtype: 17 GB
    for Llama-3.1-8B at 16 x 8192 in bf16) and the RoPE tables are allocated on the load device
    once; the model is not meant to be moved afterwards."""

    rope_cos: torch.Tensor  # [max_seq_len, head_dim] fp32
    rope_sin: torch.Tensor

    def __init__(
        self,
        cfg: LlamaConfig,
        linears: Mapping[str, nn.Module],
        tensors: Mapping[str, torch.Tensor],
        *,
        max_batch_size: int = 16,
        max_seq_len: int = 8192,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        use_cuda_graphs: bool = True,
        attention: str = "builtin",
    ) -> None:
        super().__init__(cfg, linears, tensors)
        self.dtype = dtype
        first = next(iter(tensors.values()))
        target = torch.device(device) if device is not None else first.device
        self.cache = KVCache(
            cfg.num_hidden_layers,
            max_batch_size,
            cfg.num_key_value_heads,
            max_seq_len,
            cfg.head_size,
            dtype,
            target,
        )
        # Computed once for every position the cache can hold, then indexed: the same values
        # rope_tables gives for any slice of positions, without per-step host work.
        cos, sin = rope_tables(cfg, torch.arange(max_seq_len, device=target))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.use_cuda_graphs = use_cuda_graphs
        self.use_triton: bool | None = None  # decode attention: None = Triton on CUDA when it imports
        self._graphs: DecodeGraphs | None = None
        self.parallel: str | None = None  # how this rank shares the model, when it is sharded
        check_attention(attention, target)
        self.attention = attention
        self._flashinfer: FlashInferAttention | None = None
        if attention == "flashinfer":
            self._flashinfer = FlashInferAttention(self.cache, cfg.num_attention_heads, dtype, target)
        self.plans_on_host = self._flashinfer is not None  # step needs host_positions

    @property
    def device(self) -> torch.device:
        return self.rope_cos.device

    @property
    def max_batch_size(self) -> int:
        return self.cache.max_batch_size

    @property
    def max_seq_len(self) -> int:
        return self.cache.max_seq_len

    def _tables(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        if t <= self.rope_cos.shape[0]:
            return self.rope_cos[:t], self.rope_sin[:t]
        return rope_tables(self.cfg, torch.arange(t, device=self.rope_cos.device))

    def forward(self, input_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] for token ids [B, T]: the full causal forward, no cache."""
        check_token_ids("model(input_ids)", input_ids, self.cfg.vocab_size, self.cfg.max_position_embeddings)
        h = self.model.embed_tokens(input_ids).to(dtype or self.dtype)
        cos, sin = self._tables(input_ids.shape[-1])
        return self.lm_head(self.model.run_layers(h, cos, sin))

    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Right-padded prompts [B, T] with lengths [B] (device): fills cache rows 0..B-1 at
        positions 0..T-1 and returns the logits [B, vocab] of each row's last real token (lm_head
        runs on those B rows only, not on all B x T)."""
        b, t = input_ids.shape
        if self._flashinfer is not None:
            self._flashinfer.plan_prefill(b, t)
        context = PrefillAttention(self.cache, self._flashinfer)
        h = self.model.embed_tokens(input_ids).to(self.dtype)
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        normed = self.model.run_layers(h, cos, sin, context)
        return self.lm_head(normed[torch.arange(b, device=h.device), lengths - 1])

    def decode_step(
        self, tokens: torch.Tensor, positions: torch.Tensor, limit: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row: tokens [B] at positions [B] (device) -> (logits [B, vocab], argmax [B]).

        Writes each row's K/V at its own position and attends to positions 0..positions[b].
        limit (a host bound on positions + 1) only narrows the eager torch attention's read; a
        captured step passes None."""
        h = self.model.embed_tokens(tokens)[:, None].to(self.dtype)
        cos = self.rope_cos[positions][:, None]  # [B, 1, D]: each row at its own position
        sin = self.rope_sin[positions][:, None]
        context = DecodeAttention(self.cache, positions, limit, self.use_triton, self._flashinfer)
        logits = self.lm_head(self.model.run_layers(h, cos, sin, context)[:, 0])
        return logits, logits.argmax(-1)

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        limit: int | None = None,
        host_positions: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """decode_step, replayed from a CUDA graph when on CUDA and use_cuda_graphs is set.
        host_positions (positions, known on the host) is what FlashInfer attention plans from."""
        graphs = None
        if self.use_cuda_graphs and tokens.is_cuda:
            if self._graphs is None:
                from fp8route.models.decode_graphs import DecodeGraphs

                self._graphs = DecodeGraphs(self.decode_step, self.max_batch_size, tokens.device)
            graphs = self._graphs
        if self._flashinfer is not None:
            if host_positions is None:
                raise Fp8InputError("attention='flashinfer' plans each decode step from host_positions; pass them")
            self._flashinfer.plan_decode(graphs.bucket(len(tokens)) if graphs else len(tokens), host_positions)
        if graphs is not None:
            return graphs.run(tokens, positions)
        return self.decode_step(tokens, positions, limit)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        prompt_lengths: Sequence[int] | torch.Tensor | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        on_token: Callable[[int, torch.Tensor], None] | None = None,
        eos_check_every: int = 1,
        return_logits: bool = False,
    ) -> torch.Tensor | Generation:
        """Token ids [B, T + max_new_tokens]; see fp8route.models.generate.generate."""
        from fp8route.models.generate import generate

        return generate(
            self,
            input_ids,
            max_new_tokens,
            prompt_lengths=prompt_lengths,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            on_token=on_token,
            eos_check_every=eos_check_every,
            return_logits=return_logits,
        )
