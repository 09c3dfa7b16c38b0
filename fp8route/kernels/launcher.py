"""Launching a Triton kernel again without Triton's per-call argument binding.

`kernel[grid](*args, **meta)` binds every argument to the signature, specializes each one, builds
a cache key, reads the current device and stream and checks the kernel's globals, on every call.
For a decode-sized GEMM that host time is longer than the GEMM. A DirectLauncher goes through
Triton once per key and then calls the compiled kernel's own launcher with the same arguments.

The key replaces Triton's specialization, so it must pin everything Triton specializes on that can
change between calls: the caller names the dtypes and the integer arguments (their values, or
int_key's classes) in its key; the launcher adds each pointer's 16-byte alignment, the device, and
meta's values (the constexprs and launch options: a compiled kernel has them baked in). Float
arguments need nothing: Triton passes them as fp32 values and never specializes on them.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

import torch

from fp8route.kernels.options import kernel_options
from fp8route.kernels.pdl import launch_options
from fp8route.kernels.triton_support import triton

log = logging.getLogger("fp8route")

# The compiled launcher's calling convention, (grid, stream, function, packed metadata, launch
# metadata, enter hook, exit hook, *every bound argument constexprs included), is that of Triton
# 3.4 to 3.9's JITFunction.run (each checked on a CPU by tests/kernels/test_compile_sm90.py, the
# direct launch against Triton's own; 3.6 on the H200 too). Other versions keep their own path, and
# so does Triton's interpreter (TRITON_INTERPRET=1), which compiles nothing.
DIRECT_VERSIONS = ((3, 4), (3, 9))
_TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2]) if triton is not None else (0, 0)
DIRECT = DIRECT_VERSIONS[0] <= _TRITON_VERSION <= DIRECT_VERSIONS[1] and not triton.knobs.runtime.interpret
_DIRECT_RANGE = "{}.{}-{}.{}".format(*DIRECT_VERSIONS[0], *DIRECT_VERSIONS[1])


_first_launches: list[str] = []  # "kernel key" of each launched through Triton's own path, in this process


def first_launches() -> int:
    """How many (kernel, key) pairs have launched for the first time in this process, each through
    Triton's own path: a compile, or a read of Triton's cache. One during a measured run is a step
    that waited for it."""
    return len(_first_launches)


def first_launched(since: int = 0) -> list[str]:
    """The kernel and full key of each first launch after the first `since`: what a step waited for."""
    return _first_launches[since:]


def int_key(*values: int) -> tuple[tuple[bool, bool, bool], ...]:
    """What Triton specializes an integer argument on (== 1, divisible by 16, fits in 32 bits), for a
    key whose arguments take many values: one entry per class, not per value (a prefill's token count)."""
    return tuple((v == 1, v % 16 == 0, -(2**31) <= v < 2**31) for v in values)


class DirectLauncher:
    """One Triton kernel, launched straight from its compiled form after the first call per key.

    The kernel's parameters must be the runtime arguments first, pointers (tensors) leading, then
    the constexprs; `meta` gives every constexpr and launch option by name (hashable values). With
    pdl the kernel's last constexpr is USE_PDL (fp8route.kernels.pdl): the launcher sets
    it, and the launch option, as kernel_options().pdl says.
    """

    def __init__(self, fn: Any, pointers: int, pdl: bool = False) -> None:
        self.fn = fn
        self.pointers = pointers
        self.pdl = pdl
        self._compiled: dict[Hashable, tuple[Any, tuple[Any, ...]]] = {}
        self._seen: set[Hashable] = set()  # every key launched, direct or not
        self._warned = False

    def __call__(self, grid: tuple[int, ...], key: Hashable, args: tuple[Any, ...], meta: dict[str, Any]) -> None:
        device = args[0].get_device()
        misaligned = 0
        for i in range(self.pointers):
            if args[i].data_ptr() & 15:
                misaligned |= 1 << i
        # meta's values in its order (a caller builds its meta alike each time): a constexpr left out
        # of the caller's key (as rope's head size once was) cannot reuse another value's kernel.
        use_pdl = self.pdl and kernel_options().pdl
        full_key = (key, misaligned, device, use_pdl, *meta.values())
        entry = self._compiled.get(full_key)
        if entry is not None and _no_launch_hooks():
            kernel, constexprs = entry
            # The stream Triton itself reads for the current device; a graph being captured records it.
            stream = torch._C._cuda_getCurrentRawStream(device)
            grid_y = grid[1] if len(grid) > 1 else 1
            grid_z = grid[2] if len(grid) > 2 else 1
            kernel.run(grid[0], grid_y, grid_z, stream, kernel.function, kernel.packed_metadata,
                       None, None, None, *args, *constexprs)  # fmt: skip
            return
        if self.pdl:
            meta = {**meta, **launch_options()}
        if full_key not in self._seen:
            self._seen.add(full_key)
            _first_launches.append(f"{self.fn.__name__} {full_key}")
        kernel = self.fn[grid](*args, **meta)
        if not DIRECT:
            if not self._warned and not triton.knobs.runtime.interpret:
                self._warned = True
                log.warning(
                    "triton %s launches %s through its own path (about 15 us more host time per "
                    "call than triton %s, whose compiled kernels fp8route launches directly)",
                    triton.__version__,
                    self.fn.__name__,
                    _DIRECT_RANGE,
                )
            return
        params = self.fn.params[len(args) :]
        self._compiled[full_key] = (kernel, tuple(meta[p.name] for p in params))


def _no_launch_hooks() -> bool:
    """Nobody (a profiler such as proton) listens to launches: the direct path passes no hooks.
    Triton 3.4 keeps a hook or None, 3.5 on a chain of hooks that is empty by default."""
    runtime = triton.knobs.runtime
    return _idle(runtime.launch_enter_hook) and _idle(runtime.launch_exit_hook)


def _idle(hook: Any) -> bool:
    return hook is None or not getattr(hook, "calls", True)
