"""The "cupti" clock: each timed call's kernel time as CUPTI records it, read through torch.profiler."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch

from fp8route.errors import Fp8RouteError

_CALL_LABEL = "fp8route.call:"  # prefix of the profiler range around each call


def labelled(index: int, call: Callable[[], object]) -> Callable[[], None]:
    def labelled() -> None:
        with torch.profiler.record_function(f"{_CALL_LABEL}{index}"):
            call()

    return labelled


@contextlib.contextmanager
def profiling() -> Iterator[torch.profiler.profile]:
    """torch.profiler recording CPU ranges and CUDA kernels, for one profiling cycle."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        # torch's note that each profiling cycle starts afresh: one cycle per use, nothing to keep
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            yield profiler


def kernel_us_per_call(events: Sequence[object], calls: int) -> list[float]:
    """Per call of a batch timed with clock "cupti": the GPU time of the kernels launched inside
    its profiler range (torch's device_time_total: the range's own kernels and its children's)."""
    per_call: dict[int, float] = {}
    for event in events:
        name = getattr(event, "name", "")
        if name.startswith(_CALL_LABEL) and getattr(event, "device_type", None) == torch.autograd.DeviceType.CPU:
            per_call[int(name[len(_CALL_LABEL) :])] = float(event.device_time_total)  # type: ignore[attr-defined]
    missing = [i for i in range(calls) if per_call.get(i, 0.0) <= 0.0]
    if missing:
        raise Fp8RouteError(
            f"timing: CUPTI recorded no kernel time for {len(missing)} of {calls} calls (first: call {missing[0]}); "
            "the profiler did not see this GPU's kernels, use clock 'events'"
        )
    return [per_call[i] for i in range(calls)]


@functools.lru_cache(maxsize=1)
def cupti_available() -> bool:
    """Whether torch.profiler can record CUDA kernels here (CUPTI loaded)."""
    if not torch.cuda.is_available():
        return False
    from torch.profiler import ProfilerActivity, supported_activities

    return ProfilerActivity.CUDA in supported_activities()
