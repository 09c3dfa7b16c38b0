"""What fp8route knows of a device: its kind, compute capability, SM count and L2 size.

A bottom module (torch and fp8route.errors only): the backends' predicates, the routing
fingerprint and the kernels' launch configurations all read it, every default device is
decided here (default_device), and every CUDA graph is captured through capture_graph.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fp8route.errors import Fp8InputError


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cuda" or "cpu"
    capability: tuple[int, int] | None = None
    name: str = ""
    rocm: bool = False
    sm_count: int = 0
    l2_bytes: int = 0

    @classmethod
    def of(cls, device: torch.device | str) -> DeviceInfo:
        device = torch.device(device)
        if device.type != "cuda":
            return cls(type=device.type, name=device.type)
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return cls(
            type="cuda",
            capability=(props.major, props.minor),
            name=props.name,
            rocm=torch.version.hip is not None,
            sm_count=int(props.multi_processor_count),
            l2_bytes=int(props.L2_cache_size),
        )

    @property
    def identity(self) -> tuple[str, tuple[int, int] | None, int, int]:
        """Which GPU this is, as the routing fingerprint's device fields say it."""
        return (self.name, self.capability, self.sm_count, self.l2_bytes)

    @classmethod
    def fake_cuda(cls, major: int, minor: int, name: str = "fake GPU") -> DeviceInfo:
        """A device for tests and planning on machines that lack it."""
        return cls(type="cuda", capability=(major, minor), name=name)

    @property
    def has_tma(self) -> bool:
        """Whether kernels may load through TMA descriptors: an NVIDIA GPU of SM90 or later."""
        return self.type == "cuda" and not self.rocm and self.capability is not None and self.capability >= (9, 0)

    @property
    def label(self) -> str:
        if self.capability is None:
            return self.type
        return f"sm{self.capability[0]}{self.capability[1]}"


CPU = DeviceInfo(type="cpu", name="cpu")


@functools.cache
def launch_sms(device: torch.device) -> int:
    """The SMs a kernel's grid is sized for: the CUDA device's, else an H100/H200's 132 (what Triton's
    interpreter and the sm_90 compile check launch for)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def has_tma(device: torch.device) -> bool:
    """DeviceInfo.has_tma for a device, or True without a GPU (Triton's interpreter, and the sm_90 compile check)."""
    return device.type != "cuda" or DeviceInfo.of(device).has_tma


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which containers and taskset narrow),
    not every core of the machine."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_device(device: torch.device | str | None = None) -> torch.device:
    """The device given, else CUDA when torch sees a GPU, else the CPU: the one place that default
    is decided (EngineConfig.device, every command's --device)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise Fp8InputError(f"device {device!r}: not a device torch knows; use cuda, cuda:N or cpu") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise Fp8InputError(f"device {device!r}: torch sees no CUDA GPU on this machine; use cpu")
    return chosen


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """Python's cycle collector held off within (as timeit does), back as it was after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def capture_graph(graph: torch.cuda.CUDAGraph, pool: Any = None) -> Iterator[None]:
    """torch.cuda.graph(graph, pool) with the cycle collector off. A collection inside a capture can
    free an earlier engine's CUDA graphs (a model deleted in the same process), and a graph's reset is
    not permitted while a stream captures: it invalidates this capture. The cycles wait for the next
    collection after."""
    with collector_off(), torch.cuda.graph(graph, pool=pool):
        yield
