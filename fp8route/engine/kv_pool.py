"""The paged KV cache: every layer's K and V in fixed-size blocks, and the block tables that map a
sequence's positions onto them.

k and v are [layers, num_blocks, block_size, kv_heads, head_dim] (vLLM's and FlashInfer's NHD
layout): position p of a sequence lives in block table[row][p // block_size] at offset
p % block_size. Block 0 is scratch: it is never handed out, and the padded rows of a decode
graph's bucket read and write only there, so a replay cannot touch a block some request owns.

Tables are rows of a device tensor [max_rows + 1, max_blocks_per_seq] (int32); the last row is
the padding rows' (all zeros: the scratch block). A running sequence keeps one row for its life,
so a decode step only says which row each batch entry uses, never copies whole tables.

With scales (kv_cache_dtype "fp8", fp8route.engine.kv_quant) the blocks hold float8_e4m3fn: a
block of the same bytes holds twice the tokens of bf16. Writes go through store() (quantized),
torch reads through dequantize(); the Triton decode kernel reads the scales itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fp8route.engine.blocks import blocks_for
from fp8route.engine.kv_quant import FP8_KV, KVScales, dequantize_kv, quantize_kv
from fp8route.errors import Fp8InputError


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on device without stalling the host: a copy from pageable memory waits
    for everything queued on the stream before it, one from pinned memory does not."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def upload_parts(parts: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Arrays of one dtype to the device in one copy, each part's view starting 16 bytes aligned:
    Triton compiles a kernel apart for a pointer that is not, which a warm-up would not have met."""
    per = 16 // parts[0].itemsize  # values in 16 bytes
    sizes = [len(part) for part in parts]
    starts = np.cumsum([0, *(n + -n % per for n in sizes)])
    host = np.zeros(int(starts[-1]), dtype=parts[0].dtype)
    for part, start in zip(parts, starts, strict=False):
        host[start : start + len(part)] = part
    packed = upload(torch.from_numpy(host), device)
    return [packed[start : start + n] for start, n in zip(starts, sizes, strict=False)]


@dataclass(frozen=True)
class KVCacheSpec:
    """What a pool is, for those who only read about it (benchmarks, the load-time line)."""

    dtype: torch.dtype  # what the blocks hold: the model's dtype, or float8_e4m3fn
    device: torch.device
    num_blocks: int  # scratch block included
    block_size: int
    capacity_tokens: int
    bytes_per_token: int  # K and V of one position over every layer
    nbytes: int
    scales: KVScales | None  # an fp8 pool's per-layer K/V scales


class KVPool:
    def __init__(
        self,
        layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        max_rows: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device,
        scales: KVScales | None = None,
    ) -> None:
        """dtype: the model's (what reads give back); scales: store e4m3 with them, one per layer."""
        if block_size < 1 or block_size & (block_size - 1):
            raise Fp8InputError(f"KV cache: block_size must be a power of two, got {block_size}")
        if num_blocks < 2 or max_rows < 1 or max_seq_len < 1:
            raise Fp8InputError(
                f"KV cache: need at least 2 blocks (one is scratch), 1 row and 1 position; got {num_blocks} "
                f"blocks, {max_rows} rows, max_seq_len={max_seq_len}"
            )
        if scales is not None and len(scales.k) != layers:
            raise Fp8InputError(f"KV cache: {len(scales.k)} layers of scales ({scales.source}) for {layers} layers")
        shape = (layers, num_blocks, block_size, kv_heads, head_dim)
        storage = FP8_KV if scales is not None else dtype
        self.k = torch.zeros(shape, dtype=storage, device=device)
        self.v = torch.zeros(shape, dtype=storage, device=device)
        self.compute_dtype, self.scales = dtype, scales
        self.block_size, self.num_blocks, self.max_rows = block_size, num_blocks, max_rows
        self.max_seq_len = max_seq_len
        self.max_blocks_per_seq = blocks_for(max_seq_len, block_size)
        self.tables = torch.zeros((max_rows + 1, self.max_blocks_per_seq), dtype=torch.int32, device=device)
        self.pad_row = max_rows

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def dtype(self) -> torch.dtype:
        """What the blocks hold: the model's dtype, or float8_e4m3fn."""
        return self.k.dtype

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def layer_scales(self, layer: int) -> tuple[float, float]:
        """This layer's (k_scale, v_scale); 1.0 each for an unquantized pool."""
        return (1.0, 1.0) if self.scales is None else (self.scales.k[layer], self.scales.v[layer])

    @property
    def spec(self) -> KVCacheSpec:
        return KVCacheSpec(
            self.dtype, self.device, self.num_blocks, self.block_size, self.capacity_tokens, self.bytes_per_token,
            self.nbytes, self.scales,
        )  # fmt: skip

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool can hold, scratch block left out."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def bytes_per_token(self) -> int:
        """K and V of one position over every layer: what attention reads per cached token."""
        layers, _, _, kv_heads, head_dim = self.k.shape
        return self.bytes_per_block(layers, 1, kv_heads, head_dim, self.k.dtype)

    @staticmethod
    def bytes_per_block(layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * layers * block_size * kv_heads * head_dim * dtype.itemsize

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V blocks: [num_blocks, block_size, kv_heads, head_dim]."""
        return self.k[layer], self.v[layer]

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V by slot (block * block_size + offset): [num_blocks * block_size, kv_heads, head_dim]."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k and v [N, Hkv, D] into slots [N] of this layer (quantized in an fp8 pool)."""
        k_flat, v_flat = self.flat(layer)
        if self.scales is None:
            k_flat.index_copy_(0, slots, k)
            v_flat.index_copy_(0, slots, v)
            return
        k_scale, v_scale = self.layer_scales(layer)
        # As bytes: index_copy_ has no float8 kernel on the CPU.
        k_flat.view(torch.uint8).index_copy_(0, slots, quantize_kv(k, k_scale).view(torch.uint8))
        v_flat.view(torch.uint8).index_copy_(0, slots, quantize_kv(v, v_scale).view(torch.uint8))

    def dequantize(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V read from this layer's blocks, in the model's dtype (as they are, unquantized)."""
        if self.scales is None:
            return k, v
        k_scale, v_scale = self.layer_scales(layer)
        return dequantize_kv(k, k_scale, self.compute_dtype), dequantize_kv(v, v_scale, self.compute_dtype)

    def set_rows(self, rows: Sequence[int], tables: Sequence[Sequence[int]]) -> None:
        """Write whole block tables (zero-padded) for these rows: one copy to the device."""
        if not rows:
            return
        host = torch.zeros((len(rows), self.max_blocks_per_seq), dtype=torch.int32)
        for i, blocks in enumerate(tables):
            host[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.tables[upload(torch.tensor(rows, dtype=torch.int64), self.device)] = upload(host, self.device)

    def set_entries(self, rows: Sequence[int], columns: Sequence[int], blocks: Sequence[int]) -> None:
        """tables[rows[i], columns[i]] = blocks[i], for the blocks sequences gained this step: one copy."""
        if not rows:
            return
        packed = upload(torch.tensor([rows, columns, blocks], dtype=torch.int64), self.device)
        self.tables[packed[0], packed[1]] = packed[2].to(torch.int32)

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each (row, position)'s slot in flat(): device ops only, graph-safe."""
        blocks = self.tables[rows, positions // self.block_size].to(torch.int64)
        return blocks * self.block_size + positions % self.block_size
