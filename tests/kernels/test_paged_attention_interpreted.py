"""The paged attention kernel under Triton's interpreter on a CPU (TRITON_INTERPRET=1, with the triton
extra) against a plain float64 reference: one call over decode rows, fresh chunks and chunks that
continue a cached prefix, blocks shuffled through the pool, GQA (also a group of 3), bf16 and fp8
caches. tests/kernels/test_paged_attention_gpu.py runs the same checks on a GPU."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import paged
from paged_cases import MIXED, make_batch, reference, relative

from fp8route.errors import Fp8InputError
from fp8route.kernels import paged_attention as pa
from fp8route.kernels import paged_decode as pd

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1" or pa.TRITON_IMPORT_ERROR is not None or torch.cuda.is_available(),
        reason="Triton's interpreter on a CPU: needs triton and TRITON_INTERPRET=1 (on a GPU, its _gpu test covers it)",
    ),
]


@pytest.mark.parametrize(("h", "hkv", "d", "page"), [(4, 2, 32, 16), (6, 2, 16, 8), (8, 8, 64, 32)])
def test_one_call_serves_decodes_and_chunks_in_fp32(h, hkv, d, page):
    queries, lengths, singles = MIXED
    q, cache, seqs, dense = make_batch(queries, lengths, singles, h, hkv, d, page, torch.float32, torch.float32)
    out = pa.paged_attention(q, cache, seqs)
    assert out.isfinite().all()
    assert relative(out, reference(q, queries, lengths, dense, hkv)) < 1e-5  # one dropped tile is ~1e-2


# The interpreter's tl.dot misreads bfloat16 operands (Triton 3.9: a bf16 [16, 16] product off by 1e10),
# so q is fp32 here; the caches are the engine's. bf16 queries run in test_paged_attention_gpu.py.
@pytest.mark.parametrize(("cache_dtype", "scales"), [(torch.bfloat16, (1.0, 1.0)), (torch.float8_e4m3fn, (0.05, 0.02))])
def test_a_16_bit_or_fp8_cache_is_read_as_cached(cache_dtype, scales):
    queries, lengths, singles = MIXED
    q, cache, seqs, dense = make_batch(
        queries, lengths, singles, 8, 2, 32, 16, torch.float32, cache_dtype, seed=2, scales=scales
    )
    out = pa.paged_attention(q, cache, seqs)
    # The cached values are exact in fp32: only the softmax and the products round.
    assert relative(out, reference(q, queries, lengths, dense, 2)) < 1e-5


def test_a_rows_result_does_not_depend_on_the_batch():
    queries, lengths, singles = MIXED
    q, cache, seqs, _ = make_batch(queries, lengths, singles, 4, 2, 32, 16, torch.float32, torch.float32, seed=5)
    together = pa.paged_attention(q, cache, seqs)
    for i in (3, 5):  # a decode row of four segments; a continuing chunk
        start, n = int(seqs.cu_q[i]), queries[i]
        alone = pa.Sequences(
            torch.tensor([0, n], dtype=torch.int32), seqs.lengths[i : i + 1], seqs.rows[i : i + 1], int(n == 1)
        )
        out = pa.paged_attention(q[start : start + n].clone(), cache, alone)
        assert torch.equal(out, together[start : start + n])


def test_a_prompt_tokens_output_does_not_depend_on_its_chunk_in_the_multi_query_grid():
    """What a deterministic mode on a GPU can build on (issue 49): in the multi-query grid a query's
    bits are the same whatever chunk of its prompt it came in (its tiles start at position 0, and the
    tiles past it add exact zeros). A chunk of one query takes the one-query grid, whose segments
    round otherwise: the mode must send such a chunk through the multi-query grid."""
    g = torch.Generator().manual_seed(0)
    h, hkv, d, length = 4, 2, 32, 300
    k, v = torch.randn(1, hkv, 512, d, generator=g), torch.randn(1, hkv, 512, d, generator=g)
    (k_blocks, tables), (v_blocks, _) = paged(k, 16), paged(v, 16)
    cache = pa.PagedKV(k_blocks, v_blocks, tables)
    q = torch.randn(length, h, d, generator=g)
    last = {}
    for n in (2, 7, 40, 130):  # the prompt's last n tokens as one chunk
        seqs = pa.Sequences(torch.tensor([0, n]).int(), torch.tensor([length]).int(), torch.tensor([0]).int(), 0)
        last[n] = pa.paged_attention(q[length - n :].contiguous(), cache, seqs)[-1]
    assert all(torch.equal(out, last[2]) for out in last.values())


@pytest.mark.parametrize(
    ("cache_dtype", "scales", "split"), [(torch.float32, (1.0, 1.0), 64), (torch.float8_e4m3fn, (0.05, 0.02), 128)]
)
def test_decode_rows_through_the_decode_kernel_at_a_fixed_split_keep_to_their_own_length(cache_dtype, scales, split):
    """decode_split (the deterministic mode's): the one-query rows through paged_decode's kernel, split by
    their own length alone (rows of 300 and 1000 positions in several splits): the reference's result,
    and each row's bits alone as in the mixed batch, whatever else shares it."""
    queries, lengths, singles = MIXED
    q, cache, seqs, dense = make_batch(
        queries, lengths, singles, 4, 2, 32, 16, torch.float32, cache_dtype, seed=7, scales=scales
    )
    together = pa.paged_attention(q, cache, seqs, decode_split=split)
    assert relative(together, reference(q, queries, lengths, dense, 2)) < 1e-5
    for i in range(singles):
        alone = pa.Sequences(torch.tensor([0, 1], dtype=torch.int32), seqs.lengths[i : i + 1], seqs.rows[i : i + 1], 1)
        out = pa.paged_attention(q[i : i + 1].clone(), cache, alone, decode_split=split)
        assert torch.equal(out, together[i : i + 1]), f"decode row {i} (length {lengths[i]})"
    rest = pa.Sequences(seqs.cu_q[singles:] - singles, seqs.lengths[singles:], seqs.rows[singles:], 0)
    assert torch.equal(pa.paged_attention(q[singles:].clone(), cache, rest), together[singles:])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_counts_on_the_device_with_grids_from_bounds_give_the_same_bits(cache_dtype):
    """A captured step's form: the sequence arrays padded past the step's sequences with stale entries,
    q and out padded past its tokens, the counts read on the device; every real token's output the
    same bits as the call with the counts on the host, and the padding's rows untouched."""
    queries, lengths, singles = MIXED
    scales = (0.05, 0.02) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    q, cache, seqs, _ = make_batch(
        queries, lengths, singles, 4, 2, 32, 16, torch.float32, cache_dtype, seed=7, scales=scales
    )
    want = pa.paged_attention(q, cache, seqs)
    t, pad = q.shape[0], 40
    stale = 3  # entries past the step's sequences: a longer earlier step's, never read
    cu_q = torch.cat([seqs.cu_q, torch.full((stale,), t + pad, dtype=torch.int32)])
    lens = torch.cat([seqs.lengths, torch.full((stale,), 999, dtype=torch.int32)])
    rows = torch.cat([seqs.rows, torch.zeros(stale, dtype=seqs.rows.dtype)])
    q_padded = torch.cat([q, torch.randn(pad, *q.shape[1:])])
    for counted_singles, bound in ((singles, singles + 2), (singles, len(queries) + stale)):
        counts = torch.tensor([counted_singles, len(queries)], dtype=torch.int32)
        graph = pa.Sequences(cu_q, lens, rows, bound, counts)
        out = torch.full_like(q_padded, 7.0)
        pa.paged_attention(q_padded, cache, graph, out=out)
        assert torch.equal(out[:t], want), bound
        assert (out[t:] == 7.0).all(), "a padded token's row was written"


def test_counts_with_no_multi_query_sequences_or_no_single_ones():
    queries, lengths = [1, 1, 5, 9], [40, 300, 60, 9]
    q, cache, seqs, _ = make_batch(queries, lengths, 2, 4, 2, 32, 16, torch.float32, torch.float32, seed=8)
    for singles, count in ((2, 2), (0, 0)):  # the decode rows alone; nothing at all
        sub = pa.Sequences(seqs.cu_q[: count + 1], seqs.lengths[:count], seqs.rows[:count], singles)
        want = pa.paged_attention(q, cache, sub) if count else None
        out = torch.full_like(q, 7.0)
        graph = pa.Sequences(seqs.cu_q, seqs.lengths, seqs.rows, 4, torch.tensor([singles, count], dtype=torch.int32))
        pa.paged_attention(q, cache, graph, out=out)
        real = int(seqs.cu_q[count])
        if want is not None:
            assert torch.equal(out[:real], want[:real])
        assert (out[real:] == 7.0).all()


@pytest.mark.parametrize(("cache_dtype", "page"), [(torch.float32, 16), (torch.float8_e4m3fn, 128)])
def test_the_one_query_grids_launches_give_the_same_bits(cache_dtype, page):
    """one_query: the table read once a segment ("g"; segments of 64-position tiles start inside a
    128-position page), fp16 tiles ("h", a no-op for fp32 queries) and a register cap: the same blocks
    read in the same order, so every token's bits, decode rows of one to four segments and the chunks."""
    queries, lengths, singles = MIXED
    scales = (0.05, 0.02) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    q, cache, seqs, _ = make_batch(
        queries, lengths, singles, 4, 2, 32, page, torch.float32, cache_dtype, seed=9, scales=scales
    )
    want = pa.paged_attention(q, cache, seqs, one_query=pd.Launch(64, 4, 3))  # a table load per tile
    assert torch.equal(pa.paged_attention(q, cache, seqs), want)  # the cache's default launch
    for text in ("64x4x3g", "64x4x3hg-r128", "64x4x4g"):
        assert torch.equal(pa.paged_attention(q, cache, seqs, one_query=pd.Launch.parse(text)), want), text
    with pytest.raises(Fp8InputError, match="one-query grid's tile is 64 positions, not 128"):
        pa.paged_attention(q, cache, seqs, one_query=pd.Launch.parse("128x4x3"))
