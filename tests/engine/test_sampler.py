"""The sampler's controls against plain references on fixed logits: each distribution from many
independent draws (one row per seed) under a chi-square test, strict enough to fail when a control
is ignored or applied twice; penalties on a hand-built history; logit_bias; logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from fp8route.engine.sampler import Draw, Sampler
from fp8route.engine.sampling import SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
DRAWS = 20000
# The chi-square 1 - 1e-6 quantiles by degrees of freedom: a right sampler fails one run in a million.
CRITICAL = {1: 23.9, 2: 27.6, 3: 30.7, 4: 33.4, 5: 35.9, 6: 38.3, 7: 40.5}


def requests(params: SamplingParams, count: int, step: int = 0) -> list[Draw]:
    """count rows with params, each on its own seed, choosing output token `step`."""
    return [Draw(params, 1000 + i, step) for i in range(count)]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


def draw(
    params: SamplingParams, logits: torch.Tensor = LOGITS, count: int = DRAWS, device: str = "cpu"
) -> torch.Tensor:
    sampler = Sampler(logits.shape[-1], count + 1, torch.device(device))
    rows = torch.arange(count, device=device)
    x = logits.expand(count, -1).clone().to(device)
    tokens, _ = sampler(x, None, requests(params, count), rows, ())
    return torch.bincount(tokens.cpu(), minlength=logits.shape[-1]).double()


def chi_square(counts: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, int]:
    """The statistic over the tokens the reference gives mass; a draw it gives none is infinite."""
    support = expected_p > 0
    if counts[~support].sum() > 0:
        return math.inf, 1
    expected = expected_p[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


def assert_follows(counts: torch.Tensor, expected_p: torch.Tensor) -> None:
    stat, dof = chi_square(counts, expected_p)
    assert stat < CRITICAL[dof], f"chi-square {stat:.1f} over {dof} dof: {counts.tolist()} vs {expected_p.tolist()}"


def assert_differs(counts: torch.Tensor, expected_p: torch.Tensor) -> None:
    stat, dof = chi_square(counts, expected_p)
    assert stat > CRITICAL.get(dof, 40.5), "the test cannot tell this wrong distribution apart"


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.double(), -1)


def cut(p: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    p = p * keep
    return p / p.sum()


def reference(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The distribution written out: temperature, then min_p, top_k, top_p, each on what is left."""
    p = softmax(LOGITS / temperature)
    if min_p:
        p = cut(p, p >= min_p * p.max())
    if top_k:
        p = cut(p, torch.arange(len(p)) < top_k)  # LOGITS is sorted, highest first
    if top_p < 1:
        before = torch.cumsum(p, 0) - p
        p = cut(p, before <= top_p)
    return p


CASES = [
    ({"temperature": 0.7}, {"temperature": 0.7**2}),  # applied twice
    ({"temperature": 1.3, "top_k": 3}, {"temperature": 1.3}),  # top_k ignored
    ({"temperature": 1.0, "top_p": 0.6}, {"temperature": 1.0}),
    ({"temperature": 0.9, "min_p": 0.2}, {"temperature": 0.9}),
    ({"temperature": 1.2, "top_k": 5, "top_p": 0.8, "min_p": 0.05}, {"temperature": 1.2, "top_p": 0.8}),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("controls", "wrong"), CASES)
def test_each_control_draws_its_reference_distribution(controls, wrong, device):
    counts = draw(SamplingParams(**controls), device=device)
    assert_follows(counts, reference(**controls))
    assert_differs(counts, reference(**wrong))


def test_greedy_rows_take_the_processed_argmax_and_draw_nothing():
    counts = draw(SamplingParams(temperature=0, logit_bias={2: 5.0}), count=10)
    assert counts[2] == 10


def test_logit_bias_moves_the_right_token():
    bias = {6: 3.0, 0: -100.0}
    counts = draw(SamplingParams(temperature=1.0, logit_bias=bias))
    shifted = LOGITS.clone()
    shifted[6] += 3.0
    shifted[0] -= 100.0
    assert_follows(counts, softmax(shifted))
    assert_differs(counts, softmax(LOGITS))


def penalized(rows: int = 3) -> tuple[Sampler, list[Draw]]:
    """Sampler rows 0..rows-1 admitted with a hand-built history: prompt [1, 2], output [3, 3, 4]."""
    sampler = Sampler(len(LOGITS), rows + 1, torch.device("cpu"))
    params = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    reqs = []
    for row in range(rows):
        sampler.admit(row, [1, 2], [3, 3, 4])
        reqs.append(Draw(params, row, 3))
    return sampler, reqs


def expected_penalized(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's rule by hand: repetition on tokens 1-4 (prompt and output), then frequency and presence
    on the output's counts {3: 2, 4: 1}."""
    x = logits.clone()
    for t in (1, 2, 3, 4):
        x[t] = x[t] / 2.0 if x[t] > 0 else x[t] * 2.0
    for t, n in ((3, 2), (4, 1)):
        x[t] -= 0.5 * n + 0.25
    return x


def test_penalties_on_a_hand_built_history():
    sampler, reqs = penalized(1)
    x = LOGITS[None].clone()
    sampler._penalize(x, torch.tensor([0]), sampler._factors([reqs[0].params]))
    torch.testing.assert_close(x[0], expected_penalized(LOGITS))


def test_penalties_change_the_greedy_token_and_count_what_was_sampled():
    sampler, reqs = penalized(2)
    logits = torch.tensor([[0.0, 3.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0]] * 2)  # token 1 (seen) halves to 1.5 < 2.0
    tokens, _ = sampler(logits, logits.argmax(-1), reqs, torch.tensor([0, 1]), ())
    assert tokens.tolist() == [5, 5]
    assert sampler.counts is not None and sampler.counts[0].tolist() == [0, 0, 0, 2, 1, 1, 0, 0]


def test_min_tokens_holds_back_eos_and_stop_ids():
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(1,))
    sampler = Sampler(len(LOGITS), 2, torch.device("cpu"))
    reqs = requests(params, 1, step=1)
    tokens, _ = sampler(LOGITS[None].clone(), None, reqs, torch.tensor([0]), (0,))
    assert tokens.tolist() == [2]  # 0 is EOS, 1 a stop id: both held back before the second token
    tokens, _ = sampler(LOGITS[None].clone(), None, requests(params, 1, step=2), torch.tensor([0]), (0,))
    assert tokens.tolist() == [0]


def test_logprobs_are_the_raw_log_softmax_with_rank_and_top_k():
    params = [SamplingParams(temperature=0, logprobs=3, logit_bias={5: 10.0}), SamplingParams(temperature=0)]
    reqs = [Draw(p, 0, 0) for p in params]
    sampler = Sampler(len(LOGITS), 3, torch.device("cpu"))
    tokens, logprobs = sampler(LOGITS.expand(2, -1).clone(), None, reqs, torch.tensor([0, 1]), ())
    assert tokens.tolist() == [5, 0] and logprobs is not None and logprobs.rows == [0]
    (entry,) = logprobs.read([t.clone() for t in logprobs.tensors()], logprobs.ks)
    raw = torch.log_softmax(LOGITS, -1)
    assert entry.token == 5 and entry.rank == 6  # the model's own rank, before the bias
    assert entry.logprob == pytest.approx(raw[5].item(), abs=1e-6)
    assert entry.top_ids == (0, 1, 2)
    assert entry.top_logprobs == pytest.approx(raw[:3].tolist(), abs=1e-6)


def test_a_rows_tokens_do_not_depend_on_its_batch():
    params = SamplingParams(temperature=1.0, top_k=4, min_p=0.01, top_p=0.9)
    alone = draw(params, count=1)
    sampler = Sampler(len(LOGITS), 65, torch.device("cpu"))
    mixed = [requests(params, 1)[0]] + [
        Draw(SamplingParams(temperature=t), 7 + i, 0) for i, t in enumerate([0.0, 0.5, 2.0] * 21)
    ]
    tokens, _ = sampler(LOGITS.expand(len(mixed), -1).clone(), None, mixed, torch.arange(len(mixed)), ())
    assert alone[tokens[0]] == 1


@pytest.mark.gpu
@pytest.mark.interpreter
def test_after_its_warm_up_no_step_compiles_a_kernel(monkeypatch):
    """A load's steps change their row count and their mix of controls; a first launch in one of them
    (a compile) stalls every request for a second. After Sampler.warm_up none may: not a count of rows,
    not a step without penalties, not a top_k of any size up to WARM_TOP_K. On a CPU the kernels run
    under Triton's interpreter, on a smaller vocabulary."""
    from fp8route.bench.serve import MIXED
    from fp8route.engine.sampler import WARM_TOP_K
    from fp8route.kernels import sampling as kernels
    from fp8route.kernels.launcher import first_launched, first_launches

    cuda = torch.cuda.is_available()
    # The interpreter's bfloat16 is slow (numpy has none): float32 logits there.
    vocab, device, dtype, counts = (
        (128256, torch.device("cuda"), torch.bfloat16, (7, 1, 152, 151, 16, 199, 3)) if cuda
        else (4096, torch.device("cpu"), torch.float32, (1, 16, 17))
    )  # fmt: skip
    monkeypatch.setattr(kernels, "available", lambda x: True)  # on CPU tensors too, under the interpreter
    sampler = Sampler(vocab, max(counts) + 1, device)
    sampler.warm_up(dtype, [1])
    before = first_launches()

    def step(controls: list[dict[str, object]], n: int) -> None:
        rows = [Draw(SamplingParams(**{"temperature": 0.8, **controls[i % len(controls)]}), i, 2) for i in range(n)]
        for row, r in enumerate(rows):
            if r.params.penalized:
                sampler.admit(row, list(range(100)), [5, 6])
        logits = torch.randn(n, vocab, device=device, dtype=dtype)
        sampler(logits, None, rows, torch.arange(n, device=device), [1])

    mixed = [{**c, "logprobs": 5} for c in MIXED]
    for n in counts:
        step(mixed, n)
    for k in (20, 40, 50, 64, 100, WARM_TOP_K):
        step([{"top_k": k}, {"top_k": 1, "logprobs": 20}, {"temperature": 0, "logprobs": 1}], 5)
    step([{"min_p": 0.1, "min_tokens": 5, "max_tokens": 8}, {"presence_penalty": 0.5, "logit_bias": {3: 2.0}}], 4)
    if cuda:
        torch.cuda.synchronize()
    assert first_launched(before) == []
