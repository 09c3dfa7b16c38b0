"""CausalLM: a Llama-family model with what running it needs: a paged KV pool, its block manager,
and a runner for prefill chunks and CUDA-graph decode steps.

`model(ids)` is the full forward (no cache, for evaluation), `model.generate(ids, n)` the static
batch loop (fp8route.engine.generate), and the serving engine (fp8route.engine.llm_engine) drives
the same runner, pool and decode graphs request by request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from fp8route.engine.blocks import BlockManager
from fp8route.engine.kv_pool import KVPool, blocks_for
from fp8route.engine.kv_quant import KVScales
from fp8route.engine.runner import ModelRunner
from fp8route.errors import Fp8InputError
from fp8route.models.llama import LlamaConfig, LlamaForCausalLM
from fp8route.models.token_ids import check_token_ids

if TYPE_CHECKING:
    from fp8route.engine.generate import Generation

BLOCK_SIZE = 16  # tokens per KV block (vLLM's default): the unit of sharing a cached prefix
# Tokens one prefill forward takes at most: bounds its activations (a gate_up output of M x 28672
# for Llama-3.1-8B is 0.94 G elements at 16384) whatever the batch a caller hands in.
MAX_PREFILL_TOKENS = 16384


class CausalLM(LlamaForCausalLM):
    """A Llama-family model ready to generate.

    The KV pool holds max_batch_size x max_seq_len tokens unless num_blocks says otherwise (2 x
    layers x tokens x kv_heads x head_dim in dtype: 17 GB for Llama-3.1-8B at 16 x 8192 in bf16),
    allocated on the load device once; the model is not meant to be moved afterwards. With
    kv_scales (kv_cache_dtype "fp8": fp8route.engine.kv_quant) it holds float8_e4m3fn, half the bytes."""

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
        num_blocks: int | None = None,
        block_size: int = BLOCK_SIZE,
        enable_prefix_caching: bool = False,
        max_prefill_tokens: int = MAX_PREFILL_TOKENS,
        kv_scales: KVScales | None = None,
    ) -> None:
        super().__init__(cfg, linears, tensors)
        self.kv_scales = kv_scales
        self.dtype = dtype
        first = next(iter(tensors.values()))
        target = torch.device(device) if device is not None else first.device
        if max_prefill_tokens < 1:
            raise Fp8InputError(f"max_prefill_tokens must be at least 1, got {max_prefill_tokens}")
        self.max_prefill_tokens = max_prefill_tokens
        self.enable_prefix_caching = enable_prefix_caching
        if num_blocks is None:
            num_blocks = 1 + max_batch_size * blocks_for(max_seq_len, block_size)
        pool = self._new_pool(num_blocks, block_size, max_batch_size, max_seq_len, target)
        self.runner = ModelRunner(self, pool, dtype=dtype, use_cuda_graphs=use_cuda_graphs, attention=attention)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.parallel: str | None = None  # how this rank shares the model, when it is sharded

    def _new_pool(self, num_blocks: int, block_size: int, rows: int, max_seq_len: int, device: torch.device) -> KVPool:
        cfg = self.cfg
        return KVPool(
            cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_size,
            rows, max_seq_len, self.dtype, device, self.kv_scales,
        )  # fmt: skip

    def resize_pool(self, num_blocks: int) -> None:
        """A new pool of num_blocks (nothing may be running): the serving engine sizes it from the
        memory left after a profile run."""
        old = self.pool
        block_size, rows, max_seq_len, device = old.block_size, old.max_rows, old.max_seq_len, old.device
        self.runner.set_pool(None)  # the old pool's memory goes before the new one is taken
        del old
        self.runner.set_pool(self._new_pool(num_blocks, block_size, rows, max_seq_len, device))
        self.blocks = BlockManager(num_blocks, block_size, self.enable_prefix_caching)

    @property
    def pool(self) -> KVPool:
        return self.runner.pool

    @property
    def device(self) -> torch.device:
        return self.runner.rope_cos.device

    @property
    def kv_cache_dtype(self) -> str:
        return "auto" if self.kv_scales is None else "fp8"

    @property
    def max_batch_size(self) -> int:
        return self.pool.max_rows

    @property
    def max_seq_len(self) -> int:
        return self.pool.max_seq_len

    @property
    def attention(self) -> str:
        return self.runner.attention

    @property
    def plans_on_host(self) -> bool:
        return self.runner.plans_on_host

    @property
    def use_cuda_graphs(self) -> bool:
        return self.runner.use_cuda_graphs

    @use_cuda_graphs.setter
    def use_cuda_graphs(self, value: bool) -> None:
        self.runner.use_cuda_graphs = value

    @property
    def use_triton(self) -> bool | None:
        return self.runner.use_triton

    @use_triton.setter
    def use_triton(self, value: bool | None) -> None:
        self.runner.use_triton = value

    def check_request(self, batch: int, prompt_lengths: Sequence[int], max_new_tokens: int) -> None:
        """Raise Fp8InputError unless every row's prompt plus max_new_tokens fits the model's cache."""
        if batch > self.max_batch_size:
            raise Fp8InputError(
                f"generate: {batch} rows exceed the KV cache's max_batch_size={self.max_batch_size}; "
                "split the batch or load the model with a larger max_batch_size"
            )
        longest = max(prompt_lengths)
        if longest + max_new_tokens > self.max_seq_len:
            raise Fp8InputError(
                f"generate: a prompt of {longest} tokens + max_new_tokens={max_new_tokens} = "
                f"{longest + max_new_tokens} exceeds the KV cache's max_seq_len={self.max_seq_len}; "
                "shorten the prompt, lower max_new_tokens, or load the model with a larger max_seq_len"
            )

    def forward(self, input_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] for token ids [B, T]: the full causal forward, no cache, run over
        groups of rows of at most max_prefill_tokens tokens (a larger batch is safe, not one launch)."""
        check_token_ids("model(input_ids)", input_ids, self.cfg.vocab_size, self.cfg.max_position_embeddings)
        dtype = dtype or self.dtype
        rows = max(1, self.max_prefill_tokens // input_ids.shape[-1])
        parts = [self.logits(ids, dtype) for ids in input_ids.split(rows)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Right-padded prompts [B, T] with lengths [B]: the logits [B, vocab] of each row's last real
        token, computed as generate computes them (into blocks taken for the call and freed after)."""
        from fp8route.engine.generate import Rows, prefill_rows

        host = [int(n) for n in lengths.tolist()]
        with Rows(self, host) as rows:
            return prefill_rows(self, input_ids, host, rows)

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor | None = None,
        limit: int | None = None,
        host_lengths: Sequence[int] | None = None,
        host_blocks: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step (ModelRunner.decode); rows default to table rows 0..B-1."""
        if rows is None:
            rows = torch.arange(tokens.shape[0], device=tokens.device)
        return self.runner.decode(
            tokens, positions, rows, limit=limit, host_lengths=host_lengths, host_blocks=host_blocks
        )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> CausalLM:
        super()._apply(fn, recurse)
        self.runner.graphs = None  # they replay the tensors they captured, not the moved ones
        self.runner.prefill_graphs = None
        return self

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
        """Token ids [B, T + max_new_tokens]; see fp8route.engine.generate.generate."""
        from fp8route.engine.generate import generate

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
