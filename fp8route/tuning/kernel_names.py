"""The GPU kernels behind each timed arm, read through torch.profiler (CUPTI).

bench records them so that two runs can be compared kernel by kernel: cuBLASLt picks its kernel by
heuristics at run time, and a time that moves between processes may be another kernel or the same
one running slower. Not used while timing: the profiler is on only for one extra call per arm.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence

import torch

from fp8route.tuning.cupti import cupti_available, profiling

log = logging.getLogger("fp8route")

_LABEL = "fp8route.arm:"  # prefix of the profiler range around each arm's call


def kernels_by_arm(calls: Mapping[str, Callable[[], object]]) -> dict[str, tuple[str, ...]]:
    """Each call once, one after the other, under the profiler: the kernels it launched, in order.
    Empty tuples where the profiler cannot see the GPU (no CUDA, no CUPTI); a profiler that fails
    is logged once and gives empty tuples too, since the timings do not depend on it."""
    empty: dict[str, tuple[str, ...]] = {name: () for name in calls}
    if not cupti_available():
        return empty
    from torch.autograd import DeviceType
    from torch.profiler import record_function

    try:
        with profiling() as prof:
            for name, call in calls.items():
                with record_function(_LABEL + name):
                    call()
                    torch.cuda.synchronize()
        events = prof.events()
    except Exception as exc:  # a diagnostic: never the reason a bench fails
        _warn_once(f"kernel names not recorded: the profiler failed ({type(exc).__name__}: {exc})")
        return empty
    windows = {
        e.name[len(_LABEL) :]: (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == DeviceType.CPU and e.name.startswith(_LABEL)
    }
    kernels = [
        (e.time_range.start, e.name)
        for e in events
        if e.device_type == DeviceType.CUDA and not e.name.startswith(_LABEL)  # not the range's GPU mirror
    ]
    return {**empty, **split_by_window(windows, kernels)}


def split_by_window(
    windows: Mapping[str, tuple[float, float]], kernels: Sequence[tuple[float, str]]
) -> dict[str, tuple[str, ...]]:
    """Kernel names per arm: those that started inside the arm's window, in start order. The arms
    ran one at a time with a synchronize inside each window, so every kernel lies in exactly one."""
    ordered = sorted(kernels)
    return {arm: tuple(n for t, n in ordered if start <= t <= end) for arm, (start, end) in windows.items()}


@functools.lru_cache(maxsize=1)
def _warn_once(message: str) -> None:
    log.warning(message)
