"""The step cost an ITL target is kept with: fitted from timed steps, and what the scheduler makes of it."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from fp8route.engine.config import EngineConfig
from fp8route.engine.request import Request, RequestMetrics
from fp8route.engine.runner import ModelRunner
from fp8route.engine.sampling import SamplingParams
from fp8route.engine.scheduler import Scheduler
from fp8route.engine.step_cost import StepCost, copy_gbs, fit
from fp8route.errors import Fp8InputError

COST = StepCost(fixed_ms=1.0, per_row_ms=0.05, per_token_ms=0.01)


def test_the_fit_gives_back_the_cost_that_made_the_times():
    samples = [(rows, tokens, COST.ms(rows, tokens)) for rows, tokens in [(1, 16), (1, 512), (33, 48), (33, 512)]]
    got = fit(samples)
    assert got.fixed_ms == pytest.approx(1.0) and got.per_row_ms == pytest.approx(0.05)
    assert got.per_token_ms == pytest.approx(0.01)


def test_a_coefficient_the_times_make_negative_is_zero():
    assert fit([(1, 16, 2.0), (1, 512, 1.9), (9, 16, 2.1)]).per_token_ms == 0.0


def test_tokens_within_a_target_leave_room_for_the_fixed_and_per_row_cost():
    assert COST.tokens_within(5.0, rows=20) == 300  # (5 - 1 - 20 * 0.05) / 0.01
    assert COST.tokens_within(1.5, rows=20) == 0  # no step of 20 rows fits 1.5 ms


def test_the_cached_positions_a_step_reads_take_their_share_of_the_target():
    cost = replace(COST, per_position_ms=1e-5)
    assert cost.ms(20, 300, positions=100_000) == pytest.approx(COST.ms(20, 300) + 1.0)
    assert cost.tokens_within(5.0, rows=20, positions=100_000) == 200  # (5 - 1 - 1 - 20 * 0.05) / 0.01
    assert cost.tokens_within(5.0, rows=20, positions=400_000) == 0


def test_the_copy_bandwidth_a_position_is_priced_at_is_measured():
    assert copy_gbs(torch.device("cpu"), nbytes=16 << 20) > 0.1


def test_steps_timed_in_a_row_are_each_priced_at_their_share():
    calls = []

    def step() -> None:
        calls.append(time.perf_counter())
        time.sleep(0.002)

    cpu = SimpleNamespace(device=torch.device("cpu"))
    ms = ModelRunner._time(cpu, step, in_a_row=4)  # type: ignore[arg-type]
    assert len(calls) == 1 + 3 * 4  # an untimed call, then three timings of four
    assert 2.0 <= ms < 4.0


@pytest.mark.parametrize(
    ("device", "attention", "expected"),
    [("cuda", "builtin", True), ("cpu", "builtin", False), ("cuda", "flashinfer", False)],
)
def test_async_scheduling_is_resolved_with_the_device_so_the_step_cost_times_steps_as_they_run(
    device: str, attention: str, expected: bool
):
    config = EngineConfig(attention=attention).resolved(torch.device(device), 4096)
    assert config.async_scheduling is expected
    assert EngineConfig(async_scheduling=False).resolved(torch.device("cuda"), 4096).async_scheduling is False


def request(name: str, prompt: list[int], max_tokens: int = 64) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(name, prompt, params, 0, RequestMetrics(0.0), max_tokens=max_tokens)


def scheduler(target: float | None, cost: StepCost = COST) -> Scheduler:
    config = EngineConfig(
        max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=4096, block_size=16, itl_target_ms=target
    )
    return Scheduler(config, 4096, cost if target is not None else None)


def run_one_step(s: Scheduler) -> tuple[int, int]:
    """Schedule a step and read it back at once: its (sequences, tokens)."""
    out = s.schedule()
    for piece in out.seqs:
        request = next(r for r in s.running if r.request_id == piece.request_id)
        s.computed(request, piece)
        if piece.samples:
            request.num_pending -= 1
            request.token_ids.append(1)
    return len(out.seqs), out.num_tokens


@pytest.mark.parametrize("target", [None, 5.0])
def test_under_a_target_a_long_prompt_beside_decodes_comes_in_chunks_each_step_keeps(target):
    s = scheduler(target)
    for i in range(8):
        s.add(request(f"d{i}", [2] * 20))
    run_one_step(s)  # the eight short prompts, then they decode
    s.add(request("long", [3] * 3000, max_tokens=4))
    steps = [run_one_step(s) for _ in range(12)]
    if target is None:
        assert steps[0] == (9, 2048)  # the budget alone: the decodes and a 2040-token chunk
    else:
        assert all(COST.ms(rows, tokens) <= target for rows, tokens in steps)
        assert all(tokens >= 8 + 16 for _, tokens in steps[:5])  # the prompt moves every step
        assert sum(tokens - 8 for _, tokens in steps) >= 3000  # and is computed within these steps


def test_under_a_target_decodes_over_long_contexts_leave_a_smaller_chunk():
    chunks = {}
    for context in (20, 3000):
        s = scheduler(5.0, replace(COST, per_position_ms=1e-4))
        for i in range(8):
            s.add(request(f"d{i}", [2] * context))
        while any(r.remaining > 1 for r in s.running) or s.waiting:
            run_one_step(s)  # their prompts, in chunks the target allows
        s.add(request("long", [3] * 3000, max_tokens=4))
        rows, tokens = run_one_step(s)
        assert rows == 9
        chunks[context] = tokens - 8
    # (5 - 1 - 9 * 0.05 - positions * 1e-4) / 0.01 tokens, 8 of them the decodes': 8 x 21 positions
    # leave 353 tokens, 8 x 3001 leave 114
    assert chunks == {20: 345, 3000: 106}


def test_a_target_no_step_keeps_still_moves_every_request():
    s = scheduler(0.5)  # below the fixed cost of any step
    s.add(request("a", [1] * 100))
    rows, tokens = run_one_step(s)
    assert (rows, tokens) == (1, 16)  # a block's worth of its prompt


def test_an_itl_target_is_a_positive_number_of_milliseconds():
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(Fp8InputError, match="itl_target_ms must be a number of milliseconds > 0"):
            EngineConfig(itl_target_ms=bad)
