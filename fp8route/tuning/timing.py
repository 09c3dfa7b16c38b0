"""Kernel timing the way a model sees it: CUDA events, cold L2 by operand rotation, two reps.

Two clocks read the same schedule: "events" (default), a pair of CUDA events around each call, and
"cupti" (tuning/cupti.py), the duration of the kernels each call launched: kernels only, without
the launch edges and the gaps between a call's kernels that the events include. A model pays
those, so events stay the default.

- Cold L2 by rotation: timed call i runs on operand copy i % n, and the copies together exceed 3x
  the L2, so each call's weight comes from HBM while L2 holds clean lines of other weights, as in
  a forward pass. (A large buffer written before each call, the usual flush, leaves dirty lines
  whose write-back slows small GEMMs: it measures an artifact, not decode.)
- The host stays out of the events, checked rather than assumed: one sleep kernel, long enough
  for the host to queue every timed call behind it, goes first; an event right behind the sleep
  must still be pending once the host has queued the last call, else the batch is timed again
  with a longer sleep.
- Placement averaged: where a weight lands in memory moves a kernel's time by a few percent, so
  at least MIN_COPIES copies.
- Arms take turns inside one batch (a pass over the copies each turn), so a drift while the batch
  runs, such as the clocks dropping under the power cap, lands on every arm alike.
- Every arm runs twice, the second time in mirrored order (A B C, then C B A); a difference inside
  the spread between the two reps is a tie.

What each of these rules fixed, with the runs that showed it: benchmarks/TIMING.md.
Nothing here touches CUDA at import time.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from fp8route.device import capture_graph, collector_off
from fp8route.errors import Fp8RouteError
from fp8route.tuning.cupti import cupti_available, kernel_us_per_call, labelled, profiling

L2_ROTATION_FACTOR = 3.0  # operand copies together exceed this many L2 sizes
MIN_COPIES = 8  # at least this many copies, to average over where each one landed in memory
MAX_ROTATION_SHARE = 0.25  # ... unless they would take more of the device's memory than this
MIN_LEAD_US = 1000.0  # the shortest sleep ahead of a batch
LEAD_PER_CALL = 4.0  # sleep ahead = this many times the host's measured time to queue the batch
LEAD_ATTEMPTS = 4  # each attempt whose host fell behind quadruples the sleep
MAX_WARM_S = 2.0  # warm-up runs as long as the batch will, up to this
# Calls queued behind one sleep at most: the launch queue holds only so many kernels and events,
# and a host blocked on it falls behind (700 calls of one GEMM never got ahead; 150 of up to four
# kernels each did).
MAX_BATCH_CALLS = 150
CLOCKS = ("events", "cupti")

# A cache of torch.cuda._sleep's cycles per µs, per device (calibrated once).
_cycles_per_us: dict[int, float] = {}
# A process-wide tally (read only to report it): batches timed, and how many had to be timed again
# because the host fell behind. bench and tune print it, so a host too busy to time on is seen.
batch_counts = {"timed": 0, "host_behind": 0}


class HostBehindError(Fp8RouteError, RuntimeError):
    """The host could not queue a batch of calls ahead of the GPU even behind a long sleep: no
    timing on this machine can be trusted now, so tune and bench stop rather than record it."""


def l2_bytes(device: torch.device | int | None = None) -> int:
    return int(torch.cuda.get_device_properties(_index(device)).L2_cache_size)


def copies_for(bytes_per_copy: int, device: torch.device | int | None = None) -> int:
    """How many operand copies to rotate through: together more than 3x the L2, and at least
    MIN_COPIES while those fit in a quarter of the device's memory (never fewer than 2)."""
    size = max(1, bytes_per_copy)
    cold = int(L2_ROTATION_FACTOR * l2_bytes(device) // size) + 1
    memory = torch.cuda.get_device_properties(_index(device)).total_memory
    return max(2, cold, min(MIN_COPIES, int(MAX_ROTATION_SHARE * memory // size)))


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


def batch_summary() -> str:
    """One line for a command's output: batches timed, and those the host fell behind on."""
    timed, behind = batch_counts["timed"], batch_counts["host_behind"]
    return f"timing: {timed} batches, {behind} timed again because the host had fallen behind the GPU"


def time_cold(
    calls: Sequence[Callable[[], object]],
    *,
    repeats: int = 30,
    warmup: int = 3,
    clock: str = "events",
) -> list[float]:
    """Time `repeats` calls in µs; call i runs calls[i % len(calls)], each bound to its own operand copy.

    Build `calls` so that the copies together exceed 3x the L2 (see copies_for). Every call gets
    its own pair of events around it only; all of them are queued behind one sleep kernel, and a
    batch the host could not queue in time is timed again (HostBehindError after LEAD_ATTEMPTS).
    """
    if not calls:
        raise ValueError("time_cold: no calls to time")
    return _time_queued([calls[i % len(calls)] for i in range(repeats)], calls, warmup, clock)


def interleaved_schedule(copies_per_arm: Sequence[int], repeats: int) -> list[tuple[int, int]]:
    """(arm, copy) for each call of an interleaved batch: the arms take turns, one pass over their
    copies per turn, until each has made `repeats` calls.

    A turn of a whole pass keeps the copy sequence a plain rotation (a copy comes back only after
    all the others: cold L2), and every arm meets every copy. Turns of single calls would make
    arms that share copies read each other's weights from L2.
    """
    schedule: list[tuple[int, int]] = []
    done = [0] * len(copies_per_arm)
    while any(d < repeats for d in done):
        for arm, copies in enumerate(copies_per_arm):
            turn = min(copies, repeats - done[arm])
            schedule.extend((arm, copy) for copy in range(turn))
            done[arm] += turn
    return schedule


def time_interleaved(
    arms: Sequence[Sequence[Callable[[], object]]], *, repeats: int = 30, warmup: int = 3, clock: str = "events"
) -> list[list[float]]:
    """`repeats` calls of each arm in µs, the arms taking turns inside one batch behind one sleep
    (interleaved_schedule), so whatever drifts while the batch runs (the clocks under the power
    cap) lands on every arm alike, as it does on a model's layers."""
    if not arms or not all(arms):
        raise ValueError("time_interleaved: every arm needs calls to time")
    schedule = interleaved_schedule([len(calls) for calls in arms], repeats)
    distinct = [call for calls in arms for call in calls]
    times = _time_queued([arms[a][c] for a, c in schedule], distinct, warmup, clock)
    per_arm: list[list[float]] = [[] for _ in arms]
    for (arm, _), t in zip(schedule, times, strict=True):
        per_arm[arm].append(t)
    return per_arm


def _time_queued(
    schedule: Sequence[Callable[[], object]], distinct: Sequence[Callable[[], object]], warmup: int, clock: str
) -> list[float]:
    """Each call of the schedule timed by the clock, queued behind a sleep MAX_BATCH_CALLS at a
    time (a batch is retried with a longer sleep while the host falls behind). `distinct`: every
    call of the schedule once."""
    if clock not in CLOCKS:
        raise ValueError(f"timing: clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    if clock == "cupti" and not cupti_available():
        raise Fp8RouteError("timing: clock 'cupti' needs torch.profiler with CUDA activity (CUPTI); use 'events'")
    for _ in range(max(warmup, 1)):
        for call in distinct:
            call()
    torch.cuda.synchronize()
    # The host's cost of queueing one call, measured after warm-up (compiles and first-call setup
    # happen there), sizes the sleep.
    began = time.perf_counter()
    for call in distinct:
        call()
    host_us_per_call = (time.perf_counter() - began) * 1e6 / len(distinct)
    torch.cuda.synchronize()
    pass_s = time.perf_counter() - began
    # Long GEMMs reach the power cap within a second and the clocks drop, the state a long prefill
    # runs in: warm up for as long as the batch will run, so it is not timed half before that.
    warmed_s, batch_s = pass_s, min(MAX_WARM_S, pass_s * len(schedule) / len(distinct))
    while warmed_s < batch_s:
        began = time.perf_counter()
        for call in distinct:
            call()
        torch.cuda.synchronize()
        warmed_s += time.perf_counter() - began
    times: list[float] = []
    for start in range(0, len(schedule), MAX_BATCH_CALLS):
        times += _time_batch(schedule[start : start + MAX_BATCH_CALLS], host_us_per_call, clock)
    return times


def _time_batch(batch: Sequence[Callable[[], object]], host_us_per_call: float, clock: str) -> list[float]:
    lead_us = max(MIN_LEAD_US, LEAD_PER_CALL * host_us_per_call * len(batch))
    for _ in range(LEAD_ATTEMPTS):
        batch_counts["timed"] += 1
        times = _time_behind_sleep(batch, lead_us, clock)
        if times is not None:
            return times
        batch_counts["host_behind"] += 1
        lead_us *= 4
    raise HostBehindError(
        f"timing: the host could not queue {len(batch)} calls within a {lead_us / 4e3:.0f} ms sleep "
        f"({LEAD_ATTEMPTS} attempts); the machine is too busy to time on"
    )


def _time_behind_sleep(schedule: Sequence[Callable[[], object]], lead_us: float, clock: str) -> list[float] | None:
    """The batch's times, or None when the GPU finished the sleep before the host queued the last call."""
    if clock == "cupti":
        with profiling() as profiler:
            calls = [labelled(i, call) for i, call in enumerate(schedule)]
            host_ahead = _queue_behind_sleep(calls, lead_us)
            torch.cuda.synchronize()
        return kernel_us_per_call(profiler.events(), len(schedule)) if host_ahead else None
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in schedule]
    host_ahead = _queue_behind_sleep(
        [_between(call, *pair) for call, pair in zip(schedule, events, strict=True)], lead_us
    )
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in events] if host_ahead else None


def _queue_behind_sleep(schedule: Sequence[Callable[[], object]], lead_us: float) -> bool:
    """Queue the calls behind one sleep kernel; True when the host got them all in before it ended."""
    sleep_done = torch.cuda.Event()
    # A collection pausing the host mid-batch would only cost a retry, but timeit turns the
    # collector off for the same reason and so do we.
    with collector_off():
        torch.cuda._sleep(_sleep_cycles(lead_us))
        sleep_done.record()
        for call in schedule:
            call()
        return not sleep_done.query()


def _between(call: Callable[[], object], start: torch.cuda.Event, end: torch.cuda.Event) -> Callable[[], None]:
    def timed() -> None:
        start.record()
        call()
        end.record()

    return timed


def time_graph(calls: Sequence[Callable[[], object]], *, repeats: int = 5, warmup: int = 3) -> list[float]:
    """µs per call when the calls run back to back inside one CUDA graph, the way a decode step is
    replayed by a serving engine: launch gaps shrink to the graph's, and a kernel that saves a
    launch (a fused quantization) shows what that is worth there. One sample per replay
    (`repeats` replays), each the replay's time over len(calls).
    """
    if not calls:
        raise ValueError("time_graph: no calls to time")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(max(warmup, 1) * len(calls)):
            calls[i % len(calls)]()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        for call in calls:
            call()
    graph.replay()  # first replay uploads the graph
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    torch.cuda._sleep(_sleep_cycles(MIN_LEAD_US))
    for start, end in pairs:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 / len(calls) for start, end in pairs]


@dataclass(frozen=True)
class ArmTiming:
    """One arm's two reps: the median of each, the median of all samples, and |rep1 - rep2| / median."""

    name: str
    rep_medians_us: tuple[float, ...]
    median_us: float
    spread: float


def time_arms(
    arms: Mapping[str, Sequence[Callable[[], object]]],
    *,
    repeats: int = 30,
    warmup: int = 3,
    reps: int = 2,
    timer: Callable[..., list[float]] | None = None,
    clock: str = "events",
) -> dict[str, ArmTiming]:
    """Time every arm `reps` times; per arm its rep medians, overall median and spread.

    By default each rep is one interleaved batch (time_interleaved) with the arms' order mirrored
    from one rep to the next (A B C, then C B A). Given a timer (time_graph, say), each arm is
    timed on its own, in order A B C and then mirrored, so drift and order land on every arm alike.
    clock: how the interleaved batches are read (CLOCKS); a timer of one's own brings its own clock.
    """
    if timer is not None and clock != "events":
        raise ValueError(f"time_arms: clock {clock!r} reads the interleaved batches; a timer given times by itself")
    names = list(arms)
    samples: dict[str, list[list[float]]] = {name: [] for name in names}
    for rep in range(reps):
        order = names if rep % 2 == 0 else names[::-1]
        if timer is None:
            batch = time_interleaved([arms[n] for n in order], repeats=repeats, warmup=warmup, clock=clock)
            for name, times in zip(order, batch, strict=True):
                samples[name].append(times)
        else:
            for name in order:
                samples[name].append(timer(arms[name], repeats=repeats, warmup=warmup))
    result = {}
    for name in names:
        rep_medians = tuple(statistics.median(s) for s in samples[name])
        overall = statistics.median([t for s in samples[name] for t in s])
        spread = (max(rep_medians) - min(rep_medians)) / overall if overall > 0 else 0.0
        result[name] = ArmTiming(name, rep_medians, overall, spread)
    return result


def copy_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 20, clock: str = "events") -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written), the memory ceiling.

    One copy of `nbytes` (default 1 GiB, far beyond the L2) per timed call; median of `repeats`.
    """
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    times = time_cold([lambda: dst.copy_(src)], repeats=repeats, warmup=2, clock=clock)
    return 2 * nbytes / (statistics.median(times) * 1e-6) / 1e9


# Reps further apart than this are timed again: a wide spread makes every arm within it tie with
# that one, and a route chosen inside it can lose by as much in the next run.
STEADY_SPREAD = 0.02


Result = TypeVar("Result")


def steadiest(
    measure: Callable[[], Mapping[str, Result]], retries: int = 2, steady: float = STEADY_SPREAD
) -> Mapping[str, Result]:
    """measure(), again while its two reps disagree by more than `steady` on some arm; the
    steadiest attempt wins. A wide spread says little about the kernels, yet it makes every arm
    within it tie with that one."""
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
