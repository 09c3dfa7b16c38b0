"""The fused all-reduce + residual add + RMSNorm kernel, with two ranks emulated on one GPU: two
buffers on the device, each "rank" launching on its own stream so that both run at once, as two
GPUs would. Every rank must get the same bits: the all-reduce's sum rounded, plus the residual,
normalized.

Both ranks' kernels are first run one after the other (rank 0 finding rank 1's slot and flag
already written, as if rank 1 had run first): one process loads a kernel only when the GPU is idle
(CUDA's lazy loading), so a rank spinning on its flag would keep the other rank's first launch from
ever loading. Two processes on two GPUs do not share that."""

import pytest
import torch
from peer_cases import EPS, expected, flag_bytes, in_rank_order, ranks

from fp8route.kernels.peer_reduce import PHASES, push_add_rms_norm

pytestmark = pytest.mark.gpu

WORLD = 2


def _ranks(rows_max: int, width: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    return ranks(WORLD, rows_max, width, dtype, "cuda")


def _both(partials, residual, weight, addresses, rows_max, phase, streams):
    outs = [None] * WORLD
    for rank, stream in enumerate(streams):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            outs[rank] = push_add_rms_norm(partials[rank], residual, weight, EPS, addresses, rank, rows_max, phase)
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)
    return outs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "rows_max", "width"), [(1, 64, 4096), (5, 64, 4096), (64, 64, 4096), (3, 8, 576)])
def test_one_after_the_other(dtype, rows, rows_max, width):
    buffers, addresses = _ranks(rows_max, width, dtype)
    weight = torch.randn(width, device="cuda", dtype=dtype)
    for phase in range(PHASES):
        partials = [torch.randn(rows, width, device="cuda", dtype=dtype) for _ in range(WORLD)]
        residual = torch.randn(rows, width, device="cuda", dtype=dtype)
        outs = in_rank_order(partials, residual, weight, buffers, addresses, rows_max, phase)
        normed, total = expected(partials, residual, weight)
        for got_normed, got_total in outs:
            assert torch.equal(got_total, total)
            torch.testing.assert_close(got_normed, normed, rtol=1e-2, atol=1e-2)
        assert torch.equal(outs[0][0], outs[1][0])
    assert all(int(b[: flag_bytes(WORLD, rows_max)].count_nonzero()) == 0 for b in buffers)


def _loaded(rows_max, width, dtype):
    """Both ranks' kernels for both phases, run once one after the other (see the module's doc)."""
    buffers, addresses = _ranks(rows_max, width, dtype)
    one = [torch.zeros(1, width, device="cuda", dtype=dtype) for _ in range(WORLD)]
    weight = torch.ones(width, device="cuda", dtype=dtype)
    for phase in range(PHASES):
        in_rank_order(one, one[0], weight, buffers, addresses, rows_max, phase)
    return buffers, addresses


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "rows_max", "width"), [(1, 64, 4096), (5, 64, 4096), (64, 64, 4096), (3, 8, 576)])
def test_two_ranks_at_once_get_the_same_sum_add_and_norm(dtype, rows, rows_max, width):
    buffers, addresses = _loaded(rows_max, width, dtype)
    streams = [torch.cuda.Stream() for _ in range(WORLD)]
    weight = torch.randn(width, device="cuda", dtype=dtype)
    for call in range(6):  # both phases, each three times: the flags must come down every time
        partials = [torch.randn(rows, width, device="cuda", dtype=dtype) for _ in range(WORLD)]
        residual = torch.randn(rows, width, device="cuda", dtype=dtype)
        outs = _both(partials, residual, weight, addresses, rows_max, call % PHASES, streams)
        torch.cuda.synchronize()
        normed, total = expected(partials, residual, weight)
        for got_normed, got_total in outs:
            assert torch.equal(got_total, total)
            torch.testing.assert_close(got_normed, normed, rtol=1e-2, atol=1e-2)
        assert torch.equal(outs[0][0], outs[1][0])
    assert all(int(b[: flag_bytes(WORLD, rows_max)].count_nonzero()) == 0 for b in buffers)


def test_inside_a_cuda_graph_calls_alternate_phases_replay_after_replay():
    rows_max, width, dtype = 16, 4096, torch.bfloat16
    _, addresses = _loaded(rows_max, width, dtype)
    streams = [torch.cuda.Stream() for _ in range(WORLD)]
    weight = torch.randn(width, device="cuda", dtype=dtype)
    partials = [torch.randn(4, width, device="cuda", dtype=dtype) for _ in range(WORLD)]
    residual = torch.randn(4, width, device="cuda", dtype=dtype)

    def two_layers():
        outs = _both(partials, residual, weight, addresses, rows_max, 0, streams)
        return _both([o[1] for o in outs], residual, weight, addresses, rows_max, 1, streams)

    two_layers()  # compiles, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = two_layers()
    for _ in range(5):
        for p in partials:
            p.copy_(torch.randn_like(p))
        graph.replay()
        torch.cuda.synchronize()
        first = expected(partials, residual, weight)[1]
        normed, total = expected([first, first], residual, weight)
        for got_normed, got_total in captured:
            assert torch.equal(got_total, total)
            torch.testing.assert_close(got_normed, normed, rtol=1e-2, atol=1e-2)


def test_the_fused_method_sets_up_through_symmetric_memory_in_a_one_rank_group():
    import torch.distributed as dist

    from fp8route.kernels.fused import add_rms_norm
    from fp8route.models.collectives import AllReduce

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        reduce = AllReduce(torch.device("cuda:0"), torch.bfloat16, 512 * 1024, "fused", width=4096)
        assert reduce.method == "fused" and "up to 64 rows" in reduce.describe()
        x, r = (torch.randn(2, 1, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            normed, total = reduce.add_rms_norm(x, r, w, 1e-5)
            want = add_rms_norm(x, r, w, 1e-5)
            assert torch.equal(total, want[1]) and torch.equal(normed, want[0])
    finally:
        dist.destroy_process_group()
