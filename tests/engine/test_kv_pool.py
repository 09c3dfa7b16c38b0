"""The paged KV pool on a CPU: its capacity arithmetic, the block tables (the padding row kept on the
scratch block), slot addressing, stores, refusals, and the helpers that take host data to the device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8route import Fp8InputError
from fp8route.engine.blocks import SCRATCH_BLOCK, blocks_for
from fp8route.engine.kv_pool import KVPool, upload, upload_parts
from fp8route.engine.kv_quant import FP8_KV, KVScales

CPU = torch.device("cpu")


def pool(dtype: torch.dtype = torch.float32, scales: KVScales | None = None, **shape: int) -> KVPool:
    dims = {"layers": 2, "num_blocks": 5, "block_size": 4, "kv_heads": 2, "head_dim": 8, "max_rows": 3,
            "max_seq_len": 10} | shape  # fmt: skip
    return KVPool(**dims, dtype=dtype, device=CPU, scales=scales)


def test_the_capacity_leaves_the_scratch_block_out_and_a_row_holds_the_longest_sequence():
    p = pool()
    assert p.capacity_tokens == (5 - 1) * 4
    assert p.max_blocks_per_seq == 3 and p.tables.shape == (3 + 1, 3) and p.pad_row == 3  # ceil(10 / 4)
    assert p.k.shape == p.v.shape == (2, 5, 4, 2, 8)
    assert p.bytes_per_token == 2 * 2 * 2 * 8 * 4  # K and V, every layer, 4-byte floats
    assert p.nbytes == p.bytes_per_token * 5 * 4
    assert KVPool.bytes_per_block(2, 4, 2, 8, torch.bfloat16) == 4 * pool(torch.bfloat16).bytes_per_token
    assert [blocks_for(n, 4) for n in (1, 4, 5, 16, 17)] == [1, 1, 2, 4, 5]


def test_an_fp8_pool_holds_e4m3_half_the_bytes_of_bf16_and_reads_back_in_the_models_dtype():
    fp8, bf16 = pool(torch.bfloat16, KVScales.ones(2)), pool(torch.bfloat16)
    assert (fp8.dtype, fp8.compute_dtype, fp8.quantized) == (FP8_KV, torch.bfloat16, True)
    assert 2 * fp8.bytes_per_token == bf16.bytes_per_token and not bf16.quantized
    assert fp8.layer_scales(1) == (1.0, 1.0) == bf16.layer_scales(1)


def test_tables_are_written_whole_per_row_or_entry_by_entry_and_the_padding_row_stays_on_scratch():
    p = pool()
    p.set_rows([2, 0], [[4, 1], [3]])
    p.set_entries([0, 0], [1, 2], [2, 4])
    assert p.tables.tolist() == [[3, 2, 4], [0, 0, 0], [4, 1, 0], [SCRATCH_BLOCK] * 3]
    p.set_rows([2], [[1]])  # a row given again is zero-padded past its blocks
    assert p.tables[2].tolist() == [1, 0, 0]


def test_a_rows_position_maps_to_its_blocks_slot_and_a_store_lands_there():
    p = pool()
    p.set_rows([1], [[4, 2]])
    rows, positions = torch.tensor([1, 1, 1]), torch.tensor([0, 3, 5])
    slots = p.slots(rows, positions)
    assert slots.tolist() == [16, 19, 9]  # block 4 offsets 0 and 3, block 2 offset 1
    k = torch.arange(3 * 2 * 8, dtype=torch.float32).view(3, 2, 8)
    p.store(1, slots, k, -k)
    assert torch.equal(p.k[1, 4, 3], k[1]) and torch.equal(p.v[1, 2, 1], -k[2])
    assert not p.k[0].any()  # other layers untouched


def test_a_pool_it_cannot_address_is_refused_naming_what_is_wrong():
    with pytest.raises(Fp8InputError, match="block_size must be a power of two, got 12"):
        pool(block_size=12)
    with pytest.raises(Fp8InputError, match="need at least 2 blocks"):
        pool(num_blocks=1)
    with pytest.raises(Fp8InputError, match="3 layers of scales"):
        pool(scales=KVScales.ones(3))


def test_a_cpu_upload_is_the_host_tensor_itself_and_packed_parts_keep_their_values_aligned():
    host = torch.arange(4)
    assert upload(host, CPU) is host
    parts = [np.arange(3, dtype=np.int32), np.arange(0, dtype=np.int32), np.arange(6, dtype=np.int32) + 9]
    views = upload_parts(parts, CPU)
    assert [v.tolist() for v in views] == [p.tolist() for p in parts]
    assert [v.storage_offset() for v in views] == [0, 4, 4]  # each start rounded up to 16 bytes
