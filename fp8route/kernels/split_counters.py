"""The counters split-K kernels sum their partials by: one zeroed int32 buffer per device.

A split-K kernel writes each split's partial, then counts its arrival on its tile's counter; the split
that arrives last sums every partial in a fixed order (so the bits never depend on which came last),
writes the output and sets the counter back to zero. So the buffer is zero between launches, with no
memset and no allocation per call, and a captured CUDA graph replays it. Launches running at once on
two streams of one device would share it: they are serialized (the engine runs one stream).
"""

from __future__ import annotations

import torch

_MIN = 1 << 14
_COUNTERS: dict[torch.device, torch.Tensor] = {}
# Buffers a larger one replaced: a captured CUDA graph may still launch on them, so they are kept.
_RETIRED: list[torch.Tensor] = []


def reserve_counters(device: torch.device) -> None:
    """A device's counters, allocated now (planning calls this for layers routed to a split-K kernel)."""
    counters(device, 0, "a split-K kernel")


def counters(device: torch.device, tiles: int, kernel: str) -> torch.Tensor:
    """At least `tiles` zeroed counters on device; kernel names the caller in the error a first call
    inside CUDA-graph capture gets (the buffer cannot be allocated there)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{kernel}: run each shape once outside CUDA-graph capture first "
                "(its split-K counter buffer is allocated on first use)"
            )
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(tiles, _MIN), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def left_set(device: torch.device) -> bool:
    """Whether a counter on device is not zero (a split-K launch that did not finish its reduction)."""
    buf = _COUNTERS.get(device)
    return buf is not None and bool(buf.any())
