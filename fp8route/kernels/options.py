"""Process-wide options of fp8route's own kernels, each on by default only once a same-run measurement
on a GPU says it gains (`fp8route bench e2e --pdl auto,off,on --quantize-upstream off,on`):

- pdl: launch them with programmatic dependent launch (fp8route.kernels.pdl), Hopper on; off here by
  default, and an engine whose config leaves it open measures it per decode graph (engine.decode_graphs);
- quantize_upstream (on): where a layer's backend reads separately quantized x, the RMSNorm or SiLU-up
  kernel before it writes x quantized (fp8route.kernels.fused_quantize) instead of a quantizer
  kernel reading the bf16 x again: the same codes, a launch and a bf16 round trip fewer.

Changing them changes `launch_generation()`, which `plans_epoch()` includes, so CUDA graphs
captured before are captured again with the new kernels. `capturing_with` is the exception: options
for one capture only (the decode graphs measure each bucket with PDL and without), restored after.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from fp8route.errors import Fp8InputError
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR, triton


@dataclass(frozen=True)
class KernelOptions:
    pdl: bool = False
    quantize_upstream: bool = True


_current = [KernelOptions()]
_generation = [0]


def kernel_options() -> KernelOptions:
    return _current[0]


def set_kernel_options(*, pdl: bool | None = None, quantize_upstream: bool | None = None) -> KernelOptions:
    """Set the options given (None keeps one as it is); returns the options now. Raises
    Fp8InputError naming why when PDL is asked for where it cannot run (the current CUDA device)."""
    if pdl:
        reason = why_not_pdl()
        if reason is not None:
            raise Fp8InputError(f"programmatic dependent launch: {reason}")
    old = _current[0]
    new = replace(
        old,
        pdl=old.pdl if pdl is None else bool(pdl),
        quantize_upstream=old.quantize_upstream if quantize_upstream is None else bool(quantize_upstream),
    )
    if new != old:
        _current[0] = new
        _generation[0] += 1
    return new


@contextmanager
def capturing_with(*, pdl: bool) -> Iterator[None]:
    """PDL as given within, for a CUDA graph captured there (its caller checked why_not_pdl), and as
    it was after. The generation stays: the graph keeps the launches it captured, and the options
    outside are unchanged."""
    saved = _current[0]
    _current[0] = replace(saved, pdl=pdl)
    try:
        yield
    finally:
        _current[0] = saved


def launch_generation() -> int:
    """A number that changes whenever the kernel options change."""
    return _generation[0]


def triton_compiles_pdl() -> bool:
    """Whether this Triton can compile and launch a kernel that waits under PDL (wait_for_inputs)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:
        return False
    # Triton 3.4's gdc_* still take `_builder` where its compiler passes `_semantic`: a kernel that
    # calls them does not compile there (fp8route/kernels/compile_check.py, results/cpu/sm90_compile/).
    compiles = all("_semantic" in inspect.signature(f).parameters for f in (gdc_wait, gdc_launch_dependents))
    return compiles and "launch_pdl" in CUDAOptions.__dataclass_fields__


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
    if not triton_compiles_pdl():
        return (
            f"triton {triton.__version__} cannot launch with it (no launch_pdl option, or a gdc_wait that "
            "does not compile, as in 3.4): triton 3.5 or later can"
        )
    return None
