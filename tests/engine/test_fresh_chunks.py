"""A step's fresh chunks (prompts' first, nothing cached before them) attend over their own K/V
(SDPA a chunk at a time) while its decode rows and continuing chunks go through the paged
attention: the same outputs and the same cache as every sequence through the paged attention; the
scheduler puts fresh chunks last, and the runner sends them so only from the measured size on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from checkpoint_helpers import TINY, llama_tensors
from helpers import build_lm

from fp8route import SamplingParams
from fp8route.engine import EngineConfig
from fp8route.engine.attention import FreshChunks, StepAttention, fresh_attention
from fp8route.engine.kv_pool import KVPool
from fp8route.engine.kv_quant import KVScales
from fp8route.engine.scheduler_output import ScheduledSeq
from fp8route.kernels.paged_attention import Sequences
from fp8route.models import LlamaConfig

PAGE, HKV, G, D = 4, 2, 3, 32
# Two decode rows (at positions 5 and 9), a chunk of 6 continuing 7 cached positions, fresh chunks of 5 and 11.
QUERIES, CACHED = [1, 1, 6, 5, 11], [5, 9, 7, 0, 0]


def step(device: str, dtype: torch.dtype, fp8: bool):
    """A pool (fp8: e4m3 with scales) whose rows hold their cached positions, and the step's q/k/v,
    rotary tables and layout."""
    g = torch.Generator().manual_seed(3)
    lengths = [c + n for c, n in zip(CACHED, QUERIES, strict=True)]
    tables = []
    scales = KVScales((0.02,), (0.03,), "test") if fp8 else None
    pool = KVPool(1, 40, PAGE, HKV, D, len(QUERIES), 32, dtype, torch.device(device), scales)
    free = iter(range(39, 0, -1))  # blocks out of order, as a pool long in use hands them out
    for length in lengths:
        tables.append([next(free) for _ in range(-(-length // PAGE))])
    pool.set_rows(list(range(len(QUERIES))), tables)
    for row, cached in enumerate(CACHED):  # what earlier steps wrote
        if cached:
            slots = torch.tensor([tables[row][p // PAGE] * PAGE + p % PAGE for p in range(cached)], device=device)
            kv = torch.randn(2, cached, HKV, D, generator=g).to(device, dtype)
            pool.store(0, slots, kv[0], kv[1])
    total = sum(QUERIES)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(CACHED, QUERIES, strict=True)])
    rows = torch.repeat_interleave(torch.arange(len(QUERIES)), torch.tensor(QUERIES))
    slots = torch.tensor([tables[r][p // PAGE] * PAGE + p % PAGE for r, p in zip(rows.tolist(), positions.tolist())])
    # Views of one projection's output, as a layer passes them (rows strided by every head's width).
    qkv = torch.randn(1, total, (G + 2) * HKV * D, generator=g).to(device, dtype)
    q, k, v = (x.view(1, total, -1, D) for x in qkv.split([G * HKV * D, HKV * D, HKV * D], dim=-1))
    freqs = positions.double()[:, None] / 10000.0 ** (torch.arange(0, D, 2).double() / D)
    cos, sin = (f(torch.cat([freqs, freqs], -1)).float().to(device) for f in (torch.cos, torch.sin))
    cu = torch.tensor([0, *torch.tensor(QUERIES).cumsum(0).tolist()], device=device)  # int64, as the runner's
    seqs = Sequences(cu, torch.tensor(lengths, dtype=torch.int32, device=device),
                     torch.arange(len(QUERIES), dtype=torch.int32, device=device), 2)  # fmt: skip
    return pool, slots.to(device), seqs, (q, k, v, cos[None], sin[None])


def attend_both(device: str, dtype: torch.dtype, fp8: bool, triton: bool):
    """(output, cache) with the fresh chunks on their own, then with every sequence paged."""
    results = []
    for own in (True, False):
        pool, slots, seqs, inputs = step(device, dtype, fp8)
        bounds = tuple(seqs.cu_q[3:].tolist())
        fresh = FreshChunks(3, bounds) if own else None
        out = StepAttention(pool, slots, seqs, triton, fresh=fresh).attend(0, *inputs)
        results.append((out.float(), pool.k.float(), pool.v.float()))
    return results


@pytest.mark.parametrize("fp8", [False, True])
def test_fresh_chunks_on_their_own_equal_the_paged_path_on_a_cpu(fp8):
    (out, k, v), (paged_out, paged_k, paged_v) = attend_both("cpu", torch.float32, fp8, triton=False)
    assert torch.allclose(out, paged_out, atol=1e-5)
    assert torch.equal(k, paged_k) and torch.equal(v, paged_v)


@pytest.mark.parametrize("own", [True, False])
def test_attend_writes_into_the_buffer_it_is_given(own):
    pool, slots, seqs, inputs = step("cpu", torch.float32, False)
    fresh = FreshChunks(3, tuple(seqs.cu_q[3:].tolist())) if own else None
    expected = StepAttention(pool, slots, seqs, False, fresh=fresh).attend(0, *inputs)
    pool, slots, seqs, inputs = step("cpu", torch.float32, False)
    buffer = torch.full((sum(QUERIES), G * HKV, D), float("nan"))
    out = StepAttention(pool, slots, seqs, False, fresh=fresh).attend(0, *inputs, out=buffer)
    assert out.data_ptr() == buffer.data_ptr()
    assert torch.allclose(buffer.transpose(0, 1)[None], expected, atol=1e-6)


def test_fresh_attention_reads_chunks_padded_into_the_rows_after_them():
    """Chunks of 5, 11 and 8 read as 8, 16 and 8 rows: the next chunk's, then slack (NaN queries, zero
    K/V) past the last; each chunk's output is still its own causal attention, and only its rows are written."""
    g = torch.Generator().manual_seed(5)
    bounds, cls = [0, 5, 16, 24], 8
    rows = bounds[-1] + cls - 1
    q = torch.randn(rows, G * HKV, D, generator=g)
    k, v = torch.randn(2, rows, HKV, D, generator=g)
    q[bounds[-1] :] = float("nan")
    k[bounds[-1] :], v[bounds[-1] :] = 0, 0
    out = torch.full((bounds[-1] + 3, G * HKV, D), 7.0)
    fresh_attention(q, k, v, bounds, out[1:], cls)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        want = F.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, enable_gqa=True
        )[0].transpose(0, 1)
        assert torch.allclose(out[1 + a : 1 + b], want, atol=1e-5)
    assert (out[0] == 7).all() and (out[1 + bounds[-1] :] == 7).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fresh_chunks_through_sdpa_equal_the_paged_kernel(dtype, fp8):
    (out, k, v), (paged_out, paged_k, paged_v) = attend_both("cuda", dtype, fp8, triton=True)
    assert (out - paged_out).abs().max() < 3e-2
    assert torch.equal(k, paged_k) and torch.equal(v, paged_v)  # one kernel writes the cache on both paths


def test_the_scheduler_puts_fresh_chunks_last():
    config = EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=64, num_kv_blocks=40, block_size=4,
                          max_num_batched_tokens=24, use_cuda_graphs=False)  # fmt: skip
    engine = build_lm(LlamaConfig.from_hf(TINY), {}, llama_tensors(), config).engine
    params = SamplingParams(max_tokens=4, temperature=0)
    shared = list(range(1, 13))
    engine.add_request(shared + [20], params, request_id="first")  # leaves its prefix in the cache
    while engine.has_unfinished:
        engine.step()
    engine.add_request(list(range(30, 40)), params, request_id="fresh")
    engine.add_request(shared + [21, 22], params, request_id="hit")  # admitted after it, starting past 0
    out = engine.scheduler.schedule()
    assert [s.request_id for s in out.seqs] == ["hit", "fresh"]
    assert out.seqs[0].start > 0 and out.seqs[1].start == 0


def test_the_runner_sends_only_trailing_fresh_chunks_of_enough_tokens():
    config = EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=64, num_kv_blocks=40, block_size=4,
                          use_cuda_graphs=False)  # fmt: skip
    runner = build_lm(LlamaConfig.from_hf(TINY), {}, llama_tensors(), config).engine.runner
    assert runner.fresh_min_tokens == 1  # a CPU: any fresh chunk

    def piece(start: int, n: int) -> ScheduledSeq:
        return ScheduledSeq("r", 0, start, n, [0] * n, True, 0)

    seqs = [piece(3, 1), piece(8, 4), piece(0, 5), piece(0, 3)]
    offsets = torch.tensor([0, 1, 5, 10, 13]).numpy()
    fresh = runner._fresh(seqs, 1, offsets, runner.fresh_min_tokens)
    assert fresh is not None and fresh.first == 2 and fresh.bounds == (5, 10, 13)
    assert runner._fresh(seqs, 1, offsets, 9) is None  # 8 fresh tokens
    assert runner._fresh(seqs, 1, offsets, None) is None  # the route off
    assert runner._fresh([piece(3, 1), piece(0, 5), piece(8, 4)], 1, offsets, 1) is None  # not trailing
