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

Off until `set_kernel_options(pdl=True)` (fp8route.kernels.options).
"""

from __future__ import annotations

from typing import Any

from fp8route.kernels.options import kernel_options
from fp8route.kernels.triton_support import tl, triton


def launch_options() -> dict[str, Any]:
    """What a kernel with a USE_PDL constexpr is launched with now."""
    return {"USE_PDL": True, "launch_pdl": True} if kernel_options().pdl else {"USE_PDL": False}


if triton is not None:
    # Imported by name, not reached as tl.extra.cuda.*: Triton's JIT resolves every name a kernel's
    # source mentions, dead constexpr branches included, and tl.extra.cuda is not an attribute in
    # every build. A Triton without them gets a wait_for_inputs that mentions neither (and set_pdl
    # refuses PDL there: fp8route.kernels.options.why_not_pdl).
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:

        @triton.jit
        def wait_for_inputs(USE_PDL: tl.constexpr):
            pass

    else:

        @triton.jit
        def wait_for_inputs(USE_PDL: tl.constexpr):
            """Under PDL: wait until the kernels before this one have finished and their writes are
            visible, then let the next kernel launch. Without PDL nothing (the stream already waited)."""
            if USE_PDL:
                gdc_wait()
                gdc_launch_dependents()
