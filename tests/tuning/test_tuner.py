"""The tuner's decisions with a fake timer and fake devices: winners, ties, noise, failures."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from routing_helpers import FP, H200, only_core_backends

from fp8route import Policy, make_plan
from fp8route.backends import BACKENDS, Backend
from fp8route.backends.problem import GemmProblem
from fp8route.errors import Fp8InputError
from fp8route.routing import Timing, choose
from fp8route.routing.choose import priority_order, ties
from fp8route.tuning.timing import ArmTiming
from fp8route.tuning.tuner import Tuner

PRIORITY = priority_order(H200)  # cublas, flashinfer, rowwise, weight_only, reference, cublas_fast


@pytest.fixture(autouse=True)
def core_backends(monkeypatch):
    only_core_backends(monkeypatch)


class FakeTimer:
    """Timings from a function of (n, k, m, backend): a float is a median with 0.5% spread, a
    (median, spread) pair is used as is, a str is a failure, an exception is raised."""

    def __init__(self, fn):
        self.fn = fn
        self.calls: list[tuple[int, int, int, tuple[str, ...]]] = []

    def __call__(self, problem: GemmProblem, m: int, backends):
        assert problem.m_max == m
        self.calls.append((problem.n, problem.k, m, tuple(backends)))
        out = {}
        for name in backends:
            value = self.fn(problem.n, problem.k, m, name)
            if isinstance(value, tuple):
                out[name] = ArmTiming(name, (value[0], value[0]), value[0], value[1])
            elif isinstance(value, float):
                out[name] = ArmTiming(name, (value, value), value, 0.005)
            elif value is not None:
                out[name] = value
        return out


def tuner(fn, **kw) -> tuple[Tuner, FakeTimer]:
    timer = FakeTimer(fn)
    kw.setdefault("m_values", (1, 16, 256))
    return Tuner(timer, H200, FP, **kw), timer


def test_clear_winners_per_m_and_the_open_bucket_takes_the_largest_m():
    def fn(n, k, m, name):
        return {"cublas": 10.0 if m == 1 else 30.0, "cublas_fast": 20.0, "rowwise": 25.0 if m < 256 else 15.0}[name]

    t, timer = tuner(fn)
    table = t.tune([(4096, 4096)])
    entry = table.shapes[(4096, 4096, torch.bfloat16, False, "tensor")]
    assert entry.routes == ("cublas", "cublas_fast", "rowwise", "rowwise")
    # Only eligible, non-last-resort backends are timed (flashinfer missing, weight_only/reference last resorts).
    assert {c[3] for c in timer.calls} == {("cublas", "cublas_fast", "rowwise")}
    assert entry.timings["rowwise"][2] == Timing(15.0, 0.005)


def test_ties_inside_the_spread_go_to_the_earlier_default_priority_backend():
    # cublas_fast is 3% faster, but the spread is 5%: a tie, and cublas comes first in priority.
    t, _ = tuner(
        lambda n, k, m, name: {"cublas": (10.0, 0.05), "cublas_fast": (9.7, 0.01), "rowwise": (30.0, 0.0)}[name]
    )
    assert set(t.tune([(4096, 4096)]).shapes[(4096, 4096, torch.bfloat16, False, "tensor")].routes) == {"cublas"}


def test_a_gap_beyond_the_spread_wins_even_over_priority():
    t, _ = tuner(
        lambda n, k, m, name: {"cublas": (10.0, 0.005), "cublas_fast": (9.0, 0.005), "rowwise": (30.0, 0.0)}[name]
    )
    assert set(t.tune([(4096, 4096)]).shapes[(4096, 4096, torch.bfloat16, False, "tensor")].routes) == {"cublas_fast"}


def test_gaps_under_min_tie_are_ties_even_with_zero_spread():
    t, _ = tuner(
        lambda n, k, m, name: {"cublas": (10.0, 0.0), "cublas_fast": (9.95, 0.0), "rowwise": (30.0, 0.0)}[name]
    )
    assert set(t.tune([(4096, 4096)]).shapes[(4096, 4096, torch.bfloat16, False, "tensor")].routes) == {"cublas"}
    t, _ = tuner(
        lambda n, k, m, name: {"cublas": (10.0, 0.0), "cublas_fast": (9.95, 0.0), "rowwise": (30.0, 0.0)}[name],
        min_tie=0.0,
    )
    assert set(t.tune([(4096, 4096)]).shapes[(4096, 4096, torch.bfloat16, False, "tensor")].routes) == {"cublas_fast"}


def test_noise_does_not_flip_routes_between_runs():
    import random

    rng = random.Random(0)

    def noisy(n, k, m, name):
        base = {"cublas": 10.0, "cublas_fast": 10.0, "rowwise": 13.0}[name]
        a, b = base * (1 + rng.uniform(-0.02, 0.02)), base * (1 + rng.uniform(-0.02, 0.02))
        return ((a + b) / 2, abs(a - b) / ((a + b) / 2))

    for _ in range(5):
        t, _ = tuner(noisy, min_tie=0.03)
        assert set(t.tune([(4096, 4096)]).shapes[(4096, 4096, torch.bfloat16, False, "tensor")].routes) == {"cublas"}


def test_failing_backends_are_infinitely_slow_and_their_reasons_kept():
    def fn(n, k, m, name):
        if name == "cublas":
            return "RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"
        if name == "cublas_fast":
            return "output off the fp32 reference by 3.1e-01 (tolerance 1e-02)" if m == 16 else 1.0
        return 50.0

    t, _ = tuner(fn)
    entry = t.tune([(4096, 4096)]).shapes[(4096, 4096, torch.bfloat16, False, "tensor")]
    assert entry.routes == ("cublas_fast", "rowwise", "cublas_fast", "cublas_fast")
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in entry.failures["cublas"]
    assert entry.failures["cublas_fast"].startswith("M=16: output off")
    assert entry.timings["cublas"][0] is not None and not entry.timings["cublas"][0].ok


def test_missing_and_unusable_timings_count_as_failures():
    def fn(n, k, m, name):
        return {"cublas": None, "cublas_fast": ArmTiming("x", (), math.nan, 0.0), "rowwise": 5.0}[name]

    t, _ = tuner(fn)
    entry = t.tune([(4096, 4096)]).shapes[(4096, 4096, torch.bfloat16, False, "tensor")]
    assert set(entry.routes) == {"rowwise"}
    assert "returned nothing" in entry.failures["cublas"] and "unusable" in entry.failures["cublas_fast"]


def test_a_bucket_where_everything_failed_keeps_the_default_priority(caplog):
    t, _ = tuner(lambda n, k, m, name: "boom" if m == 256 else 1.0)
    with caplog.at_level(logging.WARNING, logger="fp8route"):
        table = t.tune([(4096, 4096)])
    assert table.shapes[(4096, 4096, torch.bfloat16, False, "tensor")].routes[2:] == (None, None)
    assert "every backend failed on 4096x4096 M=256" in caplog.text
    plan = make_plan("l", GemmProblem(4096, 4096, H200), Policy(), table)
    assert plan.backend_for(1000, torch.bfloat16).name == "cublas"


def test_only_backends_that_can_run_the_bucket_are_timed():
    t, timer = tuner(lambda n, k, m, name: 1.0, dtypes=(torch.float16,))
    t.tune([(4096, 4096), (4104, 4096)])
    timed = {(n, k): names for n, k, _, names in timer.calls}
    assert timed[(4096, 4096)] == ("cublas", "cublas_fast")  # rowwise writes bfloat16 only
    assert (4104, 4096) not in timed  # no FP8 backend takes N % 16 != 0; nothing to time


def test_explicit_backends_and_dedup_of_shapes():
    t, timer = tuner(lambda n, k, m, name: 1.0, backends=["rowwise", "weight_only"])
    table = t.tune([(4096, 4096), (4096, 4096)])
    assert len(table.shapes) == 1 and len(timer.calls) == 3
    assert {c[3] for c in timer.calls} == {("rowwise", "weight_only")}
    with pytest.raises(Fp8InputError, match="unknown backends"):
        Tuner(timer, H200, FP, backends=["nope"])
    with pytest.raises(Fp8InputError, match="increasing"):
        Tuner(timer, H200, FP, m_values=(16, 1))


def test_progress_reaches_the_total():
    seen = []
    t, _ = tuner(lambda n, k, m, name: 1.0, progress=lambda done, total, what: seen.append((done, total, what)))
    t.tune([(4096, 4096), (6144, 4096)])
    assert seen[0] == (0, 6, "4096x4096 bfloat16 M=1") and seen[-1] == (6, 6, "done")


def test_the_tuned_table_drives_plans_with_the_plan_buckets():
    def fn(n, k, m, name):
        return {"cublas": 10.0, "cublas_fast": 10.0 if m < 256 else 5.0, "rowwise": 20.0}[name]

    table = tuner(fn)[0].tune([(4096, 4096)])
    assert table.fingerprint == FP and table.m_bounds == (1, 16, 256)
    plan = make_plan("l", GemmProblem(4096, 4096, H200), Policy(), table)
    # The table bucket (16, 256] was measured at its top, M=256.
    assert plan.route_text(torch.bfloat16) == "M 1-16 -> cublas; M 17+ -> cublas_fast"


def test_choose_unit():
    assert choose({}, PRIORITY) is None
    assert choose({"rowwise": Timing(math.inf, 0)}, PRIORITY) is None
    # Ties are judged against the fastest only: rowwise ties cublas_fast, not cublas.
    timings = {"cublas": Timing(10.0, 0.0), "cublas_fast": Timing(9.0, 0.0), "rowwise": Timing(8.5, 0.1)}
    assert choose(timings, PRIORITY) == "rowwise"
    assert choose({"mystery": Timing(5.0, 0.0), "cublas": Timing(5.0, 0.0)}, PRIORITY) == "cublas"
    assert ties(Timing(math.inf, 0), Timing(math.inf, 0)) and not ties(Timing(1.0, 0), Timing(math.inf, 0))


class DummyBackend(Backend):
    def __init__(self, name: str, reason: str | None = None) -> None:
        self.name, self.summary, self.reason = name, "a test double", reason

    def why_not(self, problem: GemmProblem) -> str | None:
        return self.reason

    def run_quantized(self, x_q, x_scale, layer, out_dtype):  # type: ignore[no-untyped-def]
        raise AssertionError("never run: the timer is fake")


def test_dummy_backends_are_timed_ranked_after_the_priority_and_routed_to(monkeypatch):
    monkeypatch.setitem(BACKENDS, "dummy_fast", DummyBackend("dummy_fast"))
    monkeypatch.setitem(BACKENDS, "dummy_refused", DummyBackend("dummy_refused", "refuses everything"))
    times = {"cublas": 10.0, "cublas_fast": 10.0, "rowwise": 10.0, "dummy_fast": 10.0}
    t, timer = tuner(lambda n, k, m, name: times[name] if m == 1 else (5.0 if name == "dummy_fast" else 10.0))
    table = t.tune([(4096, 4096)])
    assert {c[3] for c in timer.calls} == {("cublas", "cublas_fast", "rowwise", "dummy_fast")}
    # A tie at M=1 goes to the default priority; a clear win elsewhere goes to the newcomer.
    routes = table.shapes[(4096, 4096, torch.bfloat16, False, "tensor")].routes
    assert routes == ("cublas", "dummy_fast", "dummy_fast", "dummy_fast")
    plan = make_plan("l", GemmProblem(4096, 4096, H200), Policy(), table)
    assert plan.route_text(torch.bfloat16) == "M 1 -> cublas; M 2+ -> dummy_fast"


def test_a_disturbed_measurement_is_taken_again_instead_of_tying_everything():
    attempts = {"n": 0}

    def fn(n, k, m, name):
        if name == "cublas" and m == 1:
            attempts["n"] += 1
            # First attempt: one rep came out 1.7x the other, so cublas would "tie" with anything.
            return (15.0, 1.2) if attempts["n"] == 1 else 15.0
        return {"cublas": 15.0, "cublas_fast": 10.0, "rowwise": 30.0}[name]

    t, timer = tuner(fn, m_values=(1,))
    table = t.tune([(4096, 4096)])
    assert [c[2] for c in timer.calls] == [1, 1]
    assert table.shapes[(4096, 4096, torch.bfloat16, False, "tensor")].routes[0] == "cublas_fast"


def test_remeasuring_gives_up_after_two_retries_and_keeps_the_steadiest():
    def fn(n, k, m, name):
        return (15.0, 0.5) if name == "cublas" else {"cublas_fast": 10.0, "rowwise": 30.0}[name]

    t, timer = tuner(fn, m_values=(1,))
    t.tune([(4096, 4096)])
    # Three tries of all arms, then (cublas still "ties" through its 50% spread) three of the
    # head to head between the default and the fastest.
    assert [len(c[3]) for c in timer.calls] == [3, 3, 3, 2, 2, 2]


def test_a_tie_that_hands_the_bucket_to_a_slower_default_is_timed_again_head_to_head():
    calls: list[tuple[str, ...]] = []

    def measure(problem, m, backends):  # type: ignore[no-untyped-def]
        calls.append(tuple(backends))
        if len(backends) > 2:  # all arms at once: cublas_fast 2% faster, inside cublas's 3% spread
            times = {"cublas": (10.0, 0.03), "cublas_fast": (9.8, 0.01), "rowwise": (30.0, 0.0)}
        else:
            times = {"cublas": (10.0, 0.004), "cublas_fast": (9.8, 0.004)}
        return {name: ArmTiming(name, (times[name][0],) * 2, *times[name]) for name in backends}

    entry = (
        Tuner(measure, H200, FP, m_values=(1,))
        .tune([(4096, 4096)])
        .shapes[(4096, 4096, torch.bfloat16, False, "tensor")]
    )
    # The first measurement is retried (a 3% spread is not steady), then the two are timed alone.
    assert calls[-1] == ("cublas", "cublas_fast") and all(len(c) == 3 for c in calls[:-1])
    assert entry.routes[0] == "cublas_fast"  # 2% apart head to head, beyond 1% and the 0.4% spreads
    assert entry.timings["cublas"][0] == Timing(10.0, 0.004)
    assert entry.timings["rowwise"][0] == Timing(30.0, 0.0)


def test_no_head_to_head_when_the_default_is_the_fastest_or_the_tie_stands():
    t, timer = tuner(lambda n, k, m, name: {"cublas": 10.0, "cublas_fast": 10.05, "rowwise": 30.0}[name])
    t.tune([(4096, 4096)])
    assert all(len(c[3]) == 3 for c in timer.calls)  # cublas is the fastest: nothing to settle
    # 0.5% apart: inside min_tie (1%), a tie however tight the spreads, so not timed again.
    t, timer = tuner(lambda n, k, m, name: {"cublas": 10.0, "cublas_fast": 9.95, "rowwise": 30.0}[name])
    entry = t.tune([(4096, 4096)]).shapes[(4096, 4096, torch.bfloat16, False, "tensor")]
    assert all(len(c[3]) == 3 for c in timer.calls)
    assert set(entry.routes) == {"cublas"}
    # 1.5% apart inside a 2% spread: timed again head to head, where it stays a tie.
    t, timer = tuner(lambda n, k, m, name: {"cublas": (10.0, 0.02), "cublas_fast": 9.85, "rowwise": 30.0}[name])
    entry = t.tune([(4096, 4096)]).shapes[(4096, 4096, torch.bfloat16, False, "tensor")]
    assert [len(c[3]) for c in timer.calls] == [3, 2] * 3
    assert set(entry.routes) == {"cublas"}
