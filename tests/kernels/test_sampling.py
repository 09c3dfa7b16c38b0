"""The sampler's kernels against its torch path (fp8route.engine.sampler, the CPU path): on a GPU, and
on a CPU under Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import math

import pytest
import torch

from fp8route.engine import sampler
from fp8route.kernels import sampling as kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.interpreter,
    pytest.mark.skipif(kernels.TRITON_IMPORT_ERROR is not None, reason="needs triton"),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 5003  # not a multiple of a block: the tails are masked
ROWS = 12


def logits(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(ROWS, VOCAB, generator=g) * 3).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_process_penalizes_as_the_torch_path_and_finds_each_rows_maximum(dtype):
    g = torch.Generator().manual_seed(1)
    source = logits().to(dtype)
    counts = torch.randint(0, 3, (ROWS + 2, VOCAB), generator=g, dtype=torch.int32).to(DEVICE)
    counts[counts == 1] = 0  # most tokens never appeared
    seen = (torch.rand(ROWS + 2, VOCAB, generator=g) < 0.1).to(DEVICE)
    table = torch.randperm(ROWS + 2, generator=g)[:ROWS].to(DEVICE)
    factors = torch.tensor([[1.0] * ROWS, [0.0] * ROWS, [0.0] * ROWS], device=DEVICE)  # neutral: untouched
    factors[:, [0, 3, 4, 9]] = torch.tensor([[1.1, 1.0, 0.8, 1.3], [0.2, 0.0, 0.5, 0.0], [0.3, 1.0, 0.0, 0.1]],
                                            device=DEVICE)  # fmt: skip
    x = torch.empty(source.shape, dtype=torch.float32, device=DEVICE)
    top = kernels.process(source, x, table, counts, seen, factors)
    rep, freq, pres = factors[:, :, None]
    c, s = counts[table], seen[table] | (counts[table] > 0)
    expected = source.float()
    expected = (
        torch.where(s, torch.where(expected > 0, expected / rep, expected * rep), expected) - freq * c - pres * (c > 0)
    )
    assert torch.allclose(x, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(x[[1, 2]], source[[1, 2]].float())  # neutral rows are the logits as float32
    assert not torch.equal(x[[0, 3, 4, 9]], source[[0, 3, 4, 9]].float())  # the case penalizes something
    assert torch.equal(top, x.amax(-1))
    assert torch.equal(kernels.process(source, x, table, None, None, None), source.float().amax(-1))
    assert torch.equal(x, source.float())


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_the_nucleus_search_keeps_what_the_sort_keeps(top_p):
    x = logits(2)
    where = torch.tensor([1, 2, 5, 6, 11], device=DEVICE)
    n = len(where)
    top = x.amax(-1)[where]
    temperature = torch.tensor([1.0, 0.5, 0.8, 2.0, 1.0], device=DEVICE)
    log_min_p = torch.tensor([-math.inf, -math.inf, math.log(0.01), -math.inf, math.log(0.2)], device=DEVICE)
    floor = top + temperature * log_min_p
    cut = torch.full((n,), top_p, device=DEVICE)
    found = kernels.nucleus_floor(x, where, top, floor, temperature, cut)
    ordered = x[where].sort(dim=-1, descending=True).values
    expected = sampler._nucleus(ordered, top, floor, temperature, cut)
    kept, expected_kept = x[where] >= found[:, None], x[where] >= expected[:, None]
    # Sums in another order may decide a token whose mass ahead is the cut to float32's rounding.
    e = torch.where(x[where] >= floor[:, None], ((x[where] - top[:, None]) / temperature[:, None]).double().exp(), 0)
    ordered, order = e.sort(dim=-1, descending=True)
    ahead = torch.empty_like(e).scatter_(-1, order, ordered.cumsum(-1) - ordered)
    at_the_cut = (ahead - top_p * e.sum(-1, keepdim=True)).abs() <= 1e-5 * e.sum(-1, keepdim=True)
    assert not ((kept != expected_kept) & ~at_the_cut).any(), (kept.sum(-1), expected_kept.sum(-1))
    assert (expected_kept.sum(-1) > 1).any()  # a cut that keeps more than the top token


def test_the_draw_takes_the_torch_paths_tokens():
    x = logits(3)
    where = torch.tensor([0, 2, 3, 7, 8, 10], device=DEVICE)
    top = x.amax(-1)[where]
    temperature = torch.tensor([1.0, 0.7, 1.5, 1.0, 0.3, 1.0], device=DEVICE)
    floor = torch.tensor([-math.inf, 0.0, -math.inf, 3.0, -math.inf, -1.0], device=DEVICE)
    seeds = torch.tensor([5, -7, 2**62, 0, 123456789, 5], device=DEVICE)
    steps = torch.tensor([0, 1, 2, 3, 400, 1], device=DEVICE)
    skip = torch.tensor([0, 0, 0, 0, 0, 40], device=DEVICE)  # the last row is drawn elsewhere
    tokens = kernels.draw(x, where, top, floor, temperature, seeds, steps, skip)
    rows = x[where]
    ids = torch.arange(VOCAB, device=DEVICE)[None]
    expected = sampler._draw_among(rows, ids, top, floor, temperature, seeds, steps)
    assert torch.equal(tokens[:-1], expected[:-1])
    assert tokens[-1] == 0
    assert (rows.gather(1, tokens[:, None])[:-1, 0] >= floor[:-1]).all()
    assert not torch.equal(tokens[:-1], rows.argmax(-1)[:-1])  # it draws, not the argmax


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.3])
def test_a_top_k_rows_draw_among_its_candidates_takes_the_torch_paths_tokens(top_p):
    g = torch.Generator().manual_seed(8)
    n, rows = 10, 16  # candidates for 10 of 16 sampled rows
    # Views of wider rows, as a sort's first k are: each row's 40 are contiguous, the rows are not.
    values = (torch.randn(n, 48, generator=g) * 2).sort(dim=-1, descending=True).values.to(DEVICE)[:, :40]
    values[3, 25:] = -math.inf  # fewer finite logits than its top_k
    ids = torch.stack([torch.randperm(VOCAB, generator=g)[:48] for _ in range(n)]).to(DEVICE)[:, :40]
    k = torch.randperm(rows, generator=g)[:n].to(DEVICE)
    top = torch.randn(rows, generator=g).to(DEVICE) + 6.0
    temperature = torch.linspace(0.3, 2.0, rows).to(DEVICE)
    floor = torch.full((rows,), -math.inf, device=DEVICE)
    floor[k[1]] = values[1, 5]  # a min_p floor above its k-th
    top_k = torch.tensor([40, 20, 1, 30, 40, 7, 40, 12, 33, 40, 2, 40, 9, 40, 40, 5], device=DEVICE)
    cut = torch.full((rows,), top_p, device=DEVICE)
    seeds = torch.arange(rows, device=DEVICE) * 7919 - 5
    steps = torch.arange(rows, device=DEVICE) * 3
    args = (values, ids, k, top, floor, temperature, cut, top_k, seeds, steps)
    tokens = kernels.draw_top_k(*args)
    assert torch.equal(tokens, sampler._draw_top_k_rows(*args))
    at = (ids == tokens[:, None]).int().argmax(-1)  # each token is one of its row's first top_k candidates
    assert (ids.gather(1, at[:, None])[:, 0] == tokens).all() and (at < top_k[k]).all()
    assert (values.gather(1, at[:, None])[:, 0] >= floor[k]).all()
    assert not torch.equal(tokens, ids[:, 0])  # it draws, not the top candidate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [VOCAB, 40000])  # one slice of a row; three, their sums added
def test_logprob_stats_are_log_softmaxs(dtype, vocab):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(ROWS, vocab, generator=g) * 3).to(DEVICE).to(dtype)
    x[3, 100:] = -math.inf  # a masked row keeps a finite sum
    x[5, : vocab // 2] = -math.inf  # whole slices masked
    x[5, -1] = 20.0
    where = torch.tensor([0, 3, 5, 11], device=DEVICE)
    tokens = torch.tensor([17, 5, vocab - 2, 4000], device=DEVICE)
    lse, own, rank = kernels.logprob_stats(x, where, tokens)
    rows = x[where].float()
    assert torch.allclose(lse, torch.logsumexp(rows, -1), atol=1e-5, rtol=1e-5)
    assert torch.equal(own, rows.gather(1, tokens[:, None])[:, 0])
    assert torch.equal(rank, (rows > own[:, None]).sum(-1) + 1)


# k = 40: 20 of the top 40 in one chunk; bf16's coarse values tie across chunks; k = 400 takes the sort.
@pytest.mark.parametrize(("dtype", "k"), [(torch.float32, 40), (torch.bfloat16, 5), (torch.bfloat16, 33),
                                          (torch.float32, 1), (torch.float32, 400)])  # fmt: skip
def test_top_candidates_are_topks(dtype, k):
    x = logits(5).to(dtype)
    x[4, 10:30] = x[4].max()  # equal values: the lower ids first, as a stable sort has them
    x[7, :] = -math.inf
    x[7, 3] = -1.5
    where = torch.tensor([4, 7, 0, 11], device=DEVICE)
    values, ids = kernels.top_candidates(x, where, k)
    rows = x[where].float()
    expected = rows.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(values, expected.values[:, :k])
    assert torch.equal(ids, expected.indices[:, :k])


def test_apply_bitmask_in_place_is_structured_outputs():
    from fp8route.engine.structured import apply_bitmask

    g = torch.Generator().manual_seed(6)
    x = logits(6)
    words = -(-VOCAB // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int32)
    bitmask[1] = -1  # every token allowed
    where = torch.tensor([2, 5, 9], device=DEVICE)
    expected = x.clone()
    expected[where] = apply_bitmask(x[where], bitmask.to(DEVICE))
    kernels.apply_bitmask_(x, where, bitmask.to(DEVICE))
    assert torch.equal(x, expected)
    assert x[2].isinf().sum() > VOCAB // 4 and not x[5].isinf().any()
