"""Triton, when it imports: CPU-only installs lack it, and the backends say so instead of failing.

Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start while the
kernel before it finishes, and waits (`gdc_wait`) only before it reads what that kernel wrote; a
kernel lets the next one start early with `gdc_launch_dependents`. The decode GEMM uses it to load its
first weight tiles while the norm or attention before it still runs, inside `pdl_scope()` only (a
model's decode step, where no kernel right before a GEMM writes its weight: weights read before the
wait must not come from the kernel being waited for). FP8ROUTE_PDL=0 turns it off.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: str | None = None
except ImportError as exc:
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    TRITON_IMPORT_ERROR = f"triton is not importable: {exc}"

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # Triton before 3.3, or none
    gdc_launch_dependents = gdc_wait = None


@functools.cache
def use_pdl(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL: SM90 or later, a Triton that has it, and
    FP8ROUTE_PDL not 0 (read once per device)."""
    if gdc_wait is None or device.type != "cuda" or os.environ.get("FP8ROUTE_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


_IN_SCOPE: ContextVar[bool] = ContextVar("fp8route_pdl_scope", default=False)


@contextmanager
def pdl_scope() -> Iterator[None]:
    """Kernels launched inside may read their static operands (weights) before waiting for the
    kernel before them."""
    token = _IN_SCOPE.set(True)
    try:
        yield
    finally:
        _IN_SCOPE.reset(token)


def in_pdl_scope() -> bool:
    return _IN_SCOPE.get()


__all__ = [
    "TRITON_IMPORT_ERROR",
    "gdc_launch_dependents",
    "gdc_wait",
    "in_pdl_scope",
    "pdl_scope",
    "tl",
    "triton",
    "use_pdl",
]
