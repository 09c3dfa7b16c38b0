"""The timing module keeps the host out of its numbers, on a real GPU."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from fp8route.tuning import timing

pytestmark = pytest.mark.gpu

KERNEL_US = 20.0


def _kernel() -> None:
    torch.cuda._sleep(timing._sleep_cycles(KERNEL_US))


def test_a_slow_host_stays_outside_the_events():
    def slow_host_call() -> None:
        time.sleep(0.002)  # 100x the kernel: a per-call sleep of 200 µs would time the host
        _kernel()

    times = timing.time_cold([slow_host_call], repeats=10, warmup=1)
    assert statistics.median(times) < 3 * KERNEL_US + 20, times


def test_a_host_that_falls_behind_is_timed_again():
    calls = 0

    def slows_down_after_warmup() -> None:
        nonlocal calls
        calls += 1
        if calls > 4:  # measured fast while sizing the sleep, then 5 ms per call
            time.sleep(0.005)
        _kernel()

    before = dict(timing.batch_counts)
    times = timing.time_cold([slows_down_after_warmup], repeats=10, warmup=1)
    assert timing.batch_counts["host_behind"] > before["host_behind"]
    assert statistics.median(times) < 3 * KERNEL_US + 20, times


def test_graph_timing_is_per_call():
    times = timing.time_graph([_kernel] * 8, repeats=3)
    assert len(times) == 3
    assert KERNEL_US * 0.5 < statistics.median(times) < 3 * KERNEL_US + 20, times


def test_interleaved_arms_keep_their_own_times():
    def kernel(us: float) -> None:
        torch.cuda._sleep(timing._sleep_cycles(us))

    short, long = [lambda: kernel(KERNEL_US)] * 4, [lambda: kernel(4 * KERNEL_US)] * 4
    timed = timing.time_arms({"short": short, "long": long}, repeats=12)
    assert timed["short"].median_us * 2.5 < timed["long"].median_us, timed
    assert all(len(s) == 12 for s in timing.time_interleaved([short, long], repeats=12))


def test_the_cupti_clock_adds_up_a_calls_kernels():
    # aten kernels: CUPTI's records of them reach the profiler range they were launched in (those
    # of torch.cuda._sleep do not, so it cannot stand in for a kernel here).
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)

    def one() -> None:
        a @ a

    def two_with_a_slow_host_between() -> None:
        a @ a
        time.sleep(0.001)  # queued behind the sleep kernel like the rest: no gap on the GPU
        a @ a

    single = statistics.median(timing.time_cold([one], repeats=10, warmup=1, clock="cupti"))
    double = timing.time_cold([two_with_a_slow_host_between], repeats=10, warmup=1, clock="cupti")
    assert all(1.6 * single < t < 2.5 * single for t in double), (single, double)


def test_both_clocks_agree_on_a_gemm():
    # One FP8 GEMM kernel per call, each on its own weight copy (cold L2): the events add only the
    # edges of one launch to what CUPTI records of the kernel (an empty kernel times 3.4 µs by events
    # on the H200, benchmarks/DECODE.md).
    weights = [
        torch.randn(4096, 4096, device="cuda").to(torch.float8_e4m3fn) for _ in range(timing.copies_for(4096 * 4096))
    ]
    x = torch.randn(16, 4096, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    calls = [
        lambda w=w: torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16) for w in weights
    ]
    timed = {clock: timing.time_arms({"gemm": calls}, repeats=30, clock=clock)["gemm"] for clock in timing.CLOCKS}
    events, cupti = timed["events"].median_us, timed["cupti"].median_us
    assert events - 4.0 < cupti <= 1.02 * events, timed
