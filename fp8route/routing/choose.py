"""How a winner is picked from timings: the fastest, unless a simpler backend ties with it.

A gap inside the measured spread is noise, and acting on noise would make routes flip from one
tuning run to the next; so among the backends that tie with the fastest, the one earliest in the
device's default priority wins (the one a user would get without any table).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from fp8route.backends import BACKENDS, default_priority
from fp8route.device import DeviceInfo

# Gaps under 1% count as ties even when two reps agreed closely: one run's spread understates
# run-to-run noise (clocks, HBM refresh), and 1% is below what a model-level benchmark resolves.
MIN_TIE = 0.01


class Timing(NamedTuple):
    median_us: float  # math.inf: the backend failed or gave a wrong result
    spread: float  # |rep1 - rep2| / median

    @property
    def ok(self) -> bool:
        return math.isfinite(self.median_us)


FAILED = Timing(math.inf, 0.0)


def ties(a: Timing, b: Timing, min_tie: float = MIN_TIE) -> bool:
    """True when the gap between a and b is inside the larger of their spreads (or min_tie)."""
    if not (a.ok and b.ok):
        return a.ok == b.ok
    slower = max(a.median_us, b.median_us)
    if slower <= 0:
        return True
    return abs(a.median_us - b.median_us) / slower <= max(a.spread, b.spread, min_tie)


def priority_order(device: DeviceInfo) -> tuple[str, ...]:
    """Default priority first, then every other known backend in registry order."""
    first = default_priority(device)
    return (*first, *(name for name in BACKENDS if name not in first))


def choose(timings: Mapping[str, Timing], priority: Sequence[str], min_tie: float = MIN_TIE) -> str | None:
    """The backend to route to, or None when every one failed."""
    ok = {name: t for name, t in timings.items() if t.ok}
    if not ok:
        return None
    fastest = min(ok.values(), key=lambda t: t.median_us)
    tied = [name for name, t in ok.items() if ties(t, fastest, min_tie)]
    rank = {name: i for i, name in enumerate(priority)}
    return min(tied, key=lambda name: (rank.get(name, len(rank)), ok[name].median_us, name))
