"""Programmatic dependent launch (PDL, Hopper and later) for fp8route's own Triton kernels.

A decode step is hundreds of short kernels, and each kernel boundary leaves the GPU partly idle:
the last blocks of one kernel drain, then the next one's blocks are placed and start. Launched with
PDL, a kernel's blocks may be placed while the kernel before it in the stream is still running; each
waits in `wait_for_inputs` until that kernel has finished and its writes are visible, and then lets
the kernel after it launch in turn. So the boundary's placement and start-up overlap the previous
kernel's tail, in CUDA graphs too (a captured PDL launch becomes a programmatic edge).

It is safe only if every PDL-launched kernel calls `wait_for_inputs` before its first load of data
another kernel may write and before its first store: each such kernel then also finishes after the
one before it, so a kernel's wait covers every earlier kernel, not just the last. A kernel launched
without PDL (torch's, cuBLAS's) waits for the whole of the one before it, as always.

Off until `set_pdl(True)`: process-wide, as a launch option of every fp8route kernel that supports
it. Turning it on or off changes `launch_generation()`, which `plans_epoch()` includes, so captured
CUDA graphs are captured again with the new launches.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8route.backends.kernels.triton_support import TRITON_IMPORT_ERROR, tl, triton
from fp8route.errors import Fp8InputError

_on = [False]
_generation = [0]


def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl.extra.cuda, "gdc_wait")


def why_not_pdl(device: torch.device | str | None = None) -> str | None:
    """Why fp8route's kernels cannot be launched with PDL on this device (default: the current CUDA
    device), or None when they can."""
    if TRITON_IMPORT_ERROR is not None:
        return TRITON_IMPORT_ERROR
    if not torch.cuda.is_available():
        return "it needs a CUDA GPU"
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        return f"it needs a CUDA GPU, not {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"it needs compute capability 9.0 or later (Hopper); this GPU has {major}.{minor}"
    if not _triton_has_pdl():
        return f"triton {triton.__version__} cannot launch with it (no launch_pdl option or gdc_wait)"
    return None


def set_pdl(on: bool, device: torch.device | str | None = None) -> None:
    """Launch fp8route's kernels with programmatic dependent launch (on) or without (off, the
    default). Raises Fp8InputError naming why when the device (default: the current one) cannot."""
    if on:
        reason = why_not_pdl(device)
        if reason is not None:
            raise Fp8InputError(f"programmatic dependent launch: {reason}")
    if on != _on[0]:
        _on[0] = on
        _generation[0] += 1


def pdl_on() -> bool:
    return _on[0]


def launch_generation() -> int:
    """A number that changes whenever the launch options of fp8route's kernels change."""
    return _generation[0]


def launch_options() -> dict[str, Any]:
    """What a kernel with a USE_PDL constexpr is launched with now."""
    return {"USE_PDL": True, "launch_pdl": True} if _on[0] else {"USE_PDL": False}


if triton is not None:

    @triton.jit
    def wait_for_inputs(USE_PDL: tl.constexpr):
        """Under PDL: wait until the kernels before this one have finished and their writes are
        visible, then let the next kernel launch. Without PDL nothing (the stream already waited)."""
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
