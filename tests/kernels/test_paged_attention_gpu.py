"""The paged attention kernel on a GPU against the float64 reference, at Llama-3.1-8B's head shapes:
decode rows and chunks in one call, bf16 and fp16 queries over 16-bit and fp8 caches, long rows of
many segments, a row's result bitwise the same alone and in a batch (decode rows through the one-query
grid, and through the decode kernel at the deterministic mode's fixed split), and a CUDA graph's replay."""

from __future__ import annotations

import pytest
import torch
from paged_cases import MIXED, make_batch, reference, relative

from fp8route.kernels import paged_attention as pa
from fp8route.kernels import paged_decode as pd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or pa.TRITON_IMPORT_ERROR is not None, reason="needs CUDA and triton"
    ),
]

# Decode rows of 1 position to 32k (16 segments), then fresh and continuing chunks of many query blocks.
LONG = ([1, 1, 1, 1, 1, 2048, 300, 17], [1, 100, 4000, 9000, 32768, 2048, 5000, 17], 5)


def on_gpu(q, cache, seqs):
    cuda = [x.cuda() for x in (q, cache.k, cache.v, cache.tables, seqs.cu_q, seqs.lengths, seqs.rows)]
    return cuda[0], pa.PagedKV(*cuda[1:4], cache.k_scale, cache.v_scale), pa.Sequences(*cuda[4:], seqs.singles)


@pytest.mark.parametrize("case", [MIXED, LONG], ids=["mixed", "long"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8", [False, True], ids=["16-bit cache", "fp8 cache"])
@pytest.mark.parametrize("decode_split", [None, pd.FIXED_SPLIT], ids=["one-query grid", "decode kernel"])
def test_the_kernel_is_the_reference(case, dtype, fp8, decode_split):
    queries, lengths, singles = case
    cache_dtype = torch.float8_e4m3fn if fp8 else (dtype if dtype != torch.float32 else torch.bfloat16)
    scales = (0.05, 0.02) if fp8 else (1.0, 1.0)
    batch = make_batch(queries, lengths, singles, 32, 8, 128, 16, dtype, cache_dtype, seed=1, scales=scales)
    q, cache, seqs = on_gpu(*batch[:3])
    out = pa.paged_attention(q, cache, seqs, decode_split=decode_split)
    torch.cuda.synchronize()
    ref = reference(batch[0], queries, lengths, batch[3], 8)
    assert out.isfinite().all()
    assert relative(out.cpu(), ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("decode_split", [None, pd.FIXED_SPLIT], ids=["one-query grid", "decode kernel"])
def test_a_rows_result_is_bitwise_the_same_alone_and_in_a_batch(decode_split):
    queries, lengths, singles = LONG
    batch = make_batch(queries, lengths, singles, 32, 8, 128, 16, torch.bfloat16, torch.bfloat16, seed=3)
    q, cache, seqs = on_gpu(*batch[:3])
    together = pa.paged_attention(q, cache, seqs, decode_split=decode_split)
    for i in range(len(queries)):
        start, n = int(seqs.cu_q[i]), queries[i]
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        alone = pa.Sequences(cu, seqs.lengths[i : i + 1], seqs.rows[i : i + 1], int(i < singles))
        out = pa.paged_attention(q[start : start + n].clone(), cache, alone, decode_split=decode_split)
        assert torch.equal(out, together[start : start + n])


def test_a_captured_call_replays_new_lengths():
    queries, lengths, singles = [1] * 8, [5, 300, 1000, 17, 4000, 1, 64, 257], 8
    batch = make_batch(queries, lengths, singles, 32, 8, 128, 16, torch.bfloat16, torch.bfloat16, seed=4)
    q, cache, seqs = on_gpu(*batch[:3])
    short = seqs.lengths.clone()
    seqs.lengths.fill_(1)
    pa.paged_attention(q, cache, seqs)  # compiled outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pa.paged_attention(q, cache, seqs)
    seqs.lengths.copy_(short)
    graph.replay()
    torch.cuda.synchronize()
    assert relative(out.cpu(), reference(batch[0], queries, lengths, batch[3], 8)) < 1e-2


@pytest.mark.parametrize("one_query", ["64x4x3h", "64x4x3g", "64x4x3hg-r128", "64x4x4g"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8", [False, True], ids=["16-bit cache", "fp8 cache"])
def test_the_one_query_grids_launches_are_the_reference(one_query, dtype, fp8):
    """The one-query grid's other launches (fp16 tiles, the table read once a segment, a register cap)
    over rows of 1 to 32k positions: the reference's result, as the default launch gives it."""
    queries, lengths, singles = LONG
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    scales = (0.05, 0.02) if fp8 else (1.0, 1.0)
    batch = make_batch(queries, lengths, singles, 32, 8, 128, 16, dtype, cache_dtype, seed=6, scales=scales)
    q, cache, seqs = on_gpu(*batch[:3])
    out = pa.paged_attention(q, cache, seqs, one_query=pd.Launch.parse(one_query))
    torch.cuda.synchronize()
    assert out.isfinite().all()
    assert relative(out.cpu(), reference(batch[0], queries, lengths, batch[3], 8)) < 1e-2
