"""FlashInfer attention over fp8route's static KV cache: `load_model(..., attention="flashinfer")`.

The cache [layers, rows, kv_heads, max_seq_len, head_dim] is, for each layer, FlashInfer's paged
cache in HND layout with one page per row (page size = max_seq_len): row b's page is page b, and
no K/V is copied. Prefill runs FlashInfer's paged prefill over the K/V just written to the cache;
decode its paged decode, captured in the CUDA graph of each batch bucket.

FlashInfer plans on the host from each row's length: prefill once per call, decode once per step
before the graph replays (every layer shares the plan). The lengths come from the host (generate
knows them), so planning adds host time per step but no sync with the GPU.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import torch

from fp8route.errors import Fp8InputError
from fp8route.models.kv_cache import KVCache

ATTENTION = ("builtin", "flashinfer")  # builtin: SDPA prefill, fp8route's Triton decode kernel
_WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partials)


def check_attention(attention: str, device: torch.device) -> None:
    """Raise Fp8InputError unless `attention` can run on `device`."""
    if attention not in ATTENTION:
        raise Fp8InputError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    if attention != "flashinfer":
        return
    if device.type != "cuda":
        raise Fp8InputError(f"attention='flashinfer' runs on CUDA GPUs; the model is on {device.type}")
    if importlib.util.find_spec("flashinfer") is None:
        raise Fp8InputError(
            "attention='flashinfer' needs FlashInfer: pip install 'fp8route[flashinfer]' (or use the builtin attention)"
        )


class FlashInferAttention:
    """The plans and wrappers one model's attention shares across its layers."""

    def __init__(self, cache: KVCache, num_heads: int, dtype: torch.dtype, device: torch.device) -> None:
        import flashinfer

        self.flashinfer = flashinfer
        self.cache, self.num_heads, self.dtype = cache, num_heads, dtype
        _, rows, self.kv_heads, self.page_size, self.head_dim = cache.k.shape
        self.workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.pages = torch.arange(rows, dtype=torch.int32, device=device)  # row b reads page b
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "HND")
        self.decoders: dict[int, Any] = {}  # one per batch bucket: a graph keeps its wrapper's buffers
        self.indptr: dict[int, torch.Tensor] = {}  # per bucket, pinned, never written again
        self.decoding: Any = None  # the decoder planned last, which decode() runs

    def plan_prefill(self, batch: int, tokens: int) -> None:
        """Rows 0..batch-1, each `tokens` long (right-padded prompts), causal."""
        qo_indptr = torch.arange(0, (batch + 1) * tokens, tokens, dtype=torch.int32)
        kv_indptr = torch.arange(batch + 1, dtype=torch.int32)
        last = torch.full((batch,), tokens, dtype=torch.int32)
        self.prefill_wrapper.plan(
            qo_indptr, kv_indptr, self.pages[:batch], last, self.num_heads, self.kv_heads, self.head_dim,
            self.page_size, causal=True, q_data_type=self.dtype, kv_data_type=self.dtype,
        )  # fmt: skip

    def prefill(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, D] whose storage is token-major ([B, T, H, D]), over this layer's cache rows
        written for positions 0..T-1 -> [B, H, T, D] (a view of token-major storage)."""
        b, h, t, d = q.shape
        out = self.prefill_wrapper.run(q.transpose(1, 2).reshape(b * t, h, d), self._layer(layer))
        return out.view(b, t, h, d).transpose(1, 2)

    def plan_decode(self, size: int, positions: Sequence[int]) -> None:
        """Before a step of `size` rows (a graph bucket, or the batch when eager): row b attends to
        positions 0..positions[b]; rows past len(positions) are a bucket's idle rows (length 1)."""
        decoder = self.decoders.get(size)
        if decoder is None:
            decoder = self.decoders[size] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "HND", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.empty(size + 1, dtype=torch.int32, device=self.pages.device),
                paged_kv_indices_buffer=torch.empty(size, dtype=torch.int32, device=self.pages.device),
                paged_kv_last_page_len_buffer=torch.empty(size, dtype=torch.int32, device=self.pages.device),
            )  # fmt: skip
            self.indptr[size] = torch.arange(size + 1, dtype=torch.int32).pin_memory()
        lengths = [p + 1 for p in positions] + [1] * (size - len(positions))
        # Host tensors, which the plan reads on the host and copies to the wrapper's buffers in
        # stream order; pinned, since a copy from pageable memory waits for the stream (the step
        # before). A fresh lengths tensor each step: the last one's copy may not have run yet.
        decoder.plan(
            self.indptr[size], self.pages[:size], torch.tensor(lengths, dtype=torch.int32).pin_memory(),
            self.num_heads, self.kv_heads, self.head_dim, self.page_size,
            q_data_type=self.dtype, kv_data_type=self.dtype,
        )  # fmt: skip
        self.decoding = decoder

    def decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [B, H, D], one token per row -> [B, H, D]."""
        if self.decoding is None:
            raise RuntimeError("FlashInferAttention.decode before plan_decode")
        return self.decoding.run(q, self._layer(layer))

    def _layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.k[layer], self.cache.v[layer]
