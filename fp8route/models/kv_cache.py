"""A static KV cache: every layer's K and V preallocated for max_batch_size x max_seq_len.

Preallocating once keeps addresses fixed, which is what lets a decode step be captured in a CUDA
graph and replayed; it also means a request either fits or is refused before any work is done.
Rows are sequences: row b's token at position p lives at [layer, b, :, p]. Lengths are kept by
the caller (generate knows them on the host without a sync), not in here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fp8route.errors import Fp8InputError


class KVCache:
    """k and v: [layers, max_batch_size, kv_heads, max_seq_len, head_dim] in dtype."""

    def __init__(
        self,
        layers: int,
        max_batch_size: int,
        kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if max_batch_size < 1 or max_seq_len < 1:
            raise Fp8InputError(
                f"KV cache: max_batch_size ({max_batch_size}) and max_seq_len ({max_seq_len}) must be at least 1"
            )
        shape = (layers, max_batch_size, kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def check_request(self, batch: int, prompt_lengths: Sequence[int], max_new_tokens: int) -> None:
        """Raise Fp8InputError unless every row's prompt plus max_new_tokens fits the cache."""
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

    def write_prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, Hkv, T, D] for positions 0..T-1 of rows 0..B-1."""
        b, _, t, _ = k.shape
        self.k[layer, :b, :, :t] = k
        self.v[layer, :b, :, :t] = v

    def views(self, layer: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V for rows 0..batch-1: [batch, Hkv, max_seq_len, D] (contiguous)."""
        return self.k[layer, :batch], self.v[layer, :batch]
