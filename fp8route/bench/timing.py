"""Kernel timing the way a model sees it: CUDA events, cold L2 by operand rotation, two reps.

- Cold L2 by rotation: timed call i runs on operand copy i % n, and the n copies together are
  more than 3x the L2, so each call's weight comes from HBM while L2 holds clean lines of other
  weights (as in a forward pass). A large buffer *written* before each call (the usual flush)
  leaves dirty lines whose write-back made M=1 times 15-25% slower on the H200: an artifact.
- A sleep kernel is queued ahead of each timed call, so the host's launch cost (tens of µs for an
  eager call) overlaps the sleep and stays outside the events.
- Every arm runs twice in mirrored order (A B C, then C B A); a difference inside the spread
  between the two reps is a tie.

Nothing here touches CUDA at import time.
"""

from __future__ import annotations

import gc
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

L2_ROTATION_FACTOR = 3.0  # operand copies together exceed this many L2 sizes
DEFAULT_SLEEP_US = 200.0  # longer than the host needs to enqueue one timed call (~30-100 µs)

_cycles_per_us: dict[int, float] = {}


def l2_bytes(device: torch.device | int | None = None) -> int:
    return int(torch.cuda.get_device_properties(_index(device)).L2_cache_size)


def copies_for(bytes_per_copy: int, device: torch.device | int | None = None) -> int:
    """How many operand copies to rotate through so that together they exceed 3x the L2 (at least 2)."""
    need = L2_ROTATION_FACTOR * l2_bytes(device)
    return max(2, int(need // max(1, bytes_per_copy)) + 1)


def _index(device: torch.device | int | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()


def _sleep_cycles(us: float) -> int:
    """Cycles for torch.cuda._sleep to spin about `us` microseconds (calibrated once per device)."""
    dev = torch.cuda.current_device()
    if dev not in _cycles_per_us:
        cycles = 2_000_000
        torch.cuda._sleep(cycles)  # first call loads the kernel; clocks ramp up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _cycles_per_us[dev] = cycles / (start.elapsed_time(end) * 1e3)
    return int(us * _cycles_per_us[dev])


def time_cold(
    calls: Sequence[Callable[[], object]],
    *,
    repeats: int = 30,
    warmup: int = 3,
    sleep_us: float = DEFAULT_SLEEP_US,
) -> list[float]:
    """Time `repeats` calls in µs; call i runs calls[i % len(calls)], each bound to its own operand copy.

    Build `calls` so that the copies together exceed 3x the L2 (see copies_for). Every call gets
    its own pair of events around it only, and a sleep kernel queued ahead of it.
    """
    if not calls:
        raise ValueError("time_cold: no calls to time")
    for i in range(max(warmup, 1) * len(calls) if warmup else 0):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    cycles = _sleep_cycles(sleep_us)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    # A collection pausing the host between two kernels of one call would leave the GPU idle
    # inside the events; timeit turns the collector off for the same reason.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for i, (start, end) in enumerate(events):
            torch.cuda._sleep(cycles)
            start.record()
            calls[i % len(calls)]()
            end.record()
    finally:
        if collecting:
            gc.enable()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in events]


@dataclass(frozen=True)
class ArmTiming:
    """One arm's two reps: the median of each, the median of all samples, and |rep1 - rep2| / median."""

    name: str
    rep_medians_us: tuple[float, ...]
    median_us: float
    spread: float

    def ties_with(self, other: ArmTiming) -> bool:
        """True when the gap between the two arms is inside the larger of their spreads."""
        gap = abs(self.median_us - other.median_us) / max(self.median_us, other.median_us)
        return gap <= max(self.spread, other.spread)


def time_arms(
    arms: Mapping[str, Sequence[Callable[[], object]]],
    *,
    repeats: int = 30,
    warmup: int = 3,
    reps: int = 2,
    sleep_us: float = DEFAULT_SLEEP_US,
) -> dict[str, ArmTiming]:
    """Time each arm `reps` times, in order A B C ... then mirrored (C B A), so drift and order
    effects land on every arm alike. Returns per arm its rep medians, overall median and spread."""
    names = list(arms)
    samples: dict[str, list[list[float]]] = {name: [] for name in names}
    for rep in range(reps):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            samples[name].append(time_cold(arms[name], repeats=repeats, warmup=warmup, sleep_us=sleep_us))
    result = {}
    for name in names:
        rep_medians = tuple(statistics.median(s) for s in samples[name])
        overall = statistics.median([t for s in samples[name] for t in s])
        spread = (max(rep_medians) - min(rep_medians)) / overall if overall > 0 else 0.0
        result[name] = ArmTiming(name, rep_medians, overall, spread)
    return result


def copy_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written), the memory ceiling.

    One copy of `nbytes` (default 1 GiB, far beyond the L2) per timed call; median of `repeats`.
    """
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    times = time_cold([lambda: dst.copy_(src)], repeats=repeats, warmup=2)
    return 2 * nbytes / (statistics.median(times) * 1e-6) / 1e9


STEADY_SPREAD = 0.05


Result = TypeVar("Result")


def steadiest(
    measure: Callable[[], Mapping[str, Result]], retries: int = 2, steady: float = STEADY_SPREAD
) -> Mapping[str, Result]:
    """measure(), again while its two reps disagree by more than `steady` on some arm; the
    steadiest attempt wins. On the H200 one rep in a few hundred came out 1.2-1.7x the other
    (clock ramps, a neighbour's burst): such a spread says nothing about the kernels, yet it makes
    every arm tie with that one."""
    best = measure()
    for _ in range(retries):
        if worst_spread(best) <= steady:
            break
        again = measure()
        if worst_spread(again) < worst_spread(best):
            best = again
    return best


def worst_spread(results: Mapping[str, object]) -> float:
    """The largest spread among the arms that gave a time (failures, as strings, have none)."""
    spreads = [getattr(r, "spread", None) for r in results.values()]
    return max((s for s in spreads if isinstance(s, float) and math.isfinite(s)), default=0.0)
