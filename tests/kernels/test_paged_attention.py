"""The paged attention's torch path (what a CPU runs, and the kernel's reference in the engine) against
a plain float64 reference, and the segment rule the kernel shares with it."""

from __future__ import annotations

import pytest
import torch
from paged_cases import MIXED, make_batch, reference, relative

from fp8route.kernels import paged_attention as pa


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_the_torch_path_is_the_reference_over_decodes_and_chunks(cache_dtype):
    queries, lengths, singles = MIXED
    scales = (0.05, 0.02) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    q, cache, seqs, dense = make_batch(
        queries, lengths, singles, 6, 2, 16, 8, torch.float32, cache_dtype, seed=7, scales=scales
    )
    out = pa.paged_attention_reference(q, cache, seqs)
    assert relative(out, reference(q, queries, lengths, dense, 2)) < 1e-5


def test_segments_come_from_the_rows_own_length():
    assert pa.splits_for(1) == (1, pa.TILE)
    assert pa.splits_for(pa.SPLIT_MIN) == (1, pa.SPLIT_MIN)
    count, size = pa.splits_for(1000)
    assert count == 4 and size % pa.TILE == 0 and (count - 1) * size < 1000 <= count * size
    assert pa.splits_for(1 << 20)[0] == pa.MAX_SPLITS
