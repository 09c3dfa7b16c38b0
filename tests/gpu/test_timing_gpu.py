"""The timing module keeps the host out of its numbers, on a real GPU."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from fp8route.bench import timing

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
