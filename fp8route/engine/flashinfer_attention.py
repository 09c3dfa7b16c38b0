"""FlashInfer attention over fp8route's paged KV cache: `load_model(..., attention="flashinfer")`.

The pool's blocks [num_blocks, BS, Hkv, D] per layer are FlashInfer's paged cache in NHD layout
with page size BS, so no K/V is copied. Prefill runs FlashInfer's paged prefill for every sequence
of a packed batch in one call per layer (a chunk continuing a sequence attends to its earlier
pages, causally aligned to its end; a mixed step's decode rows are one-token sequences of it);
decode its paged decode, captured in the CUDA graph of each batch bucket.

An fp8 pool's blocks are FlashInfer's e4m3 cache, each layer's scales passed to its calls (k_scale
folds into the softmax scale, v_scale scales the output). Unlike the builtin prefill, a fresh chunk
reads its own K/V back from the cache, rounded, as every later read does (vLLM V1 does the same).

FlashInfer plans on the host from each sequence's blocks and length: prefill once per forward,
decode once per step before the graph replays (every layer shares the plan). The caller passes
those host lists (it keeps them anyway), so planning adds host time per step but no sync.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import torch

from fp8route.engine.blocks import SCRATCH_BLOCK
from fp8route.engine.config import check_setting
from fp8route.engine.kv_pool import KVPool
from fp8route.errors import Fp8InputError

_WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partials)


def check_attention(attention: str, device: torch.device) -> None:
    """Raise Fp8InputError unless `attention` can run on `device`."""
    check_setting("attention", attention)
    if attention != "flashinfer":
        return
    if device.type != "cuda":
        raise Fp8InputError(f"attention='flashinfer' runs on CUDA GPUs; the model is on {device.type}")
    if importlib.util.find_spec("flashinfer") is None:
        raise Fp8InputError(
            "attention='flashinfer' needs FlashInfer: pip install 'fp8route[flashinfer]' (or use the builtin attention)"
        )


def page_layout(
    blocks: Sequence[Sequence[int]], lengths: Sequence[int], page: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's (indptr, indices, last page length) for sequences of these lengths (host, int32)."""
    counts = [-(-n // page) for n in lengths]
    indptr = torch.zeros(len(counts) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(counts, dtype=torch.int32).cumsum(0)
    indices = torch.tensor([b for seq, c in zip(blocks, counts, strict=True) for b in seq[:c]], dtype=torch.int32)
    last = torch.tensor([n - (c - 1) * page for n, c in zip(lengths, counts, strict=True)], dtype=torch.int32)
    return indptr, indices, last


class FlashInferAttention:
    """The plans and wrappers one model's attention shares across its layers."""

    def __init__(self, pool: KVPool, num_heads: int, dtype: torch.dtype, device: torch.device) -> None:
        import flashinfer

        self.flashinfer = flashinfer
        self.pool, self.num_heads, self.dtype = pool, num_heads, dtype
        self.kv_dtype = pool.dtype  # the model's dtype, or float8_e4m3fn
        _, _, self.page_size, self.kv_heads, self.head_dim = pool.k.shape
        self.workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decoders: dict[int, Any] = {}  # one per batch bucket: a graph keeps its wrapper's buffers
        self.decoding: Any = None  # the decoder planned last, which decode() runs

    def plan_prefill(self, lengths: Sequence[int], ends: Sequence[int], blocks: Sequence[Sequence[int]]) -> None:
        """Sequences of `lengths` new tokens each (packed in that order), the i-th ending at position
        ends[i] - 1 of the sequence whose blocks are blocks[i]; causal."""
        qo_indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.tensor(list(lengths), dtype=torch.int32).cumsum(0)
        indptr, indices, last = page_layout(blocks, ends, self.page_size)
        self.prefill_wrapper.plan(
            qo_indptr, indptr, indices, last, self.num_heads, self.kv_heads, self.head_dim, self.page_size,
            causal=True, q_data_type=self.dtype, kv_data_type=self.kv_dtype,
        )  # fmt: skip

    def prefill(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [1, H, N, D] whose storage is token-major ([1, N, H, D]) -> [1, H, N, D]."""
        _, h, n, d = q.shape
        q = q.transpose(1, 2).reshape(n, h, d)
        out = self.prefill_wrapper.run(q, self.pool.layer(layer), **self._scales(layer))
        return out.view(1, n, h, d).transpose(1, 2)

    def plan_decode(self, size: int, lengths: Sequence[int], blocks: Sequence[Sequence[int]]) -> None:
        """Before a step of `size` rows (a graph bucket, or the batch when eager): row b attends to
        lengths[b] positions of blocks[b]; rows past len(lengths) are padding (the scratch block)."""
        decoder = self.decoders.get(size)
        if decoder is None:
            device = self.pool.device
            decoder = self.decoders[size] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.empty(size + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=torch.empty(
                    size * self.pool.max_blocks_per_seq, dtype=torch.int32, device=device
                ),
                paged_kv_last_page_len_buffer=torch.empty(size, dtype=torch.int32, device=device),
            )  # fmt: skip
        pad = size - len(lengths)
        indptr, indices, last = page_layout([*blocks, *[[SCRATCH_BLOCK]] * pad], [*lengths, *[1] * pad], self.page_size)
        # Pinned host tensors, which the plan copies to the wrapper's buffers in stream order; a
        # copy from pageable memory would wait for the step before.
        decoder.plan(
            indptr.pin_memory(), indices.pin_memory(), last.pin_memory(),
            self.num_heads, self.kv_heads, self.head_dim, self.page_size,
            q_data_type=self.dtype, kv_data_type=self.kv_dtype,
        )  # fmt: skip
        self.decoding = decoder

    def decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [B, H, D], one token per row -> [B, H, D]."""
        if self.decoding is None:
            raise RuntimeError("FlashInferAttention.decode before plan_decode")
        return self.decoding.run(q, self.pool.layer(layer), **self._scales(layer))

    def _scales(self, layer: int) -> dict[str, float]:
        if not self.pool.quantized:
            return {}
        k_scale, v_scale = self.pool.layer_scales(layer)
        return {"k_scale": k_scale, "v_scale": v_scale}
