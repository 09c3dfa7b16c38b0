"""The all-reduce a row-parallel layer ends with, picked once per model at load time.

At decode a row-parallel output is a few KB to a few hundred KB per rank. NCCL's ring protocol
costs ~12 µs per call for that inside a CUDA graph, twice per layer; a one-shot all-reduce over
peer memory (each rank copies its partial into a buffer every rank can address, one barrier,
then each rank reads all partials over NVLink and sums them) is one small kernel. PyTorch's
symmetric memory provides it (`torch.ops.symm_mem.one_shot_all_reduce_copy`) without NVLink
multicast, which stays off (MULTICAST_OFF). Larger messages (prefill) go through NCCL, which
reaches the link bandwidth there; CPUs (gloo) always take dist.all_reduce.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from fp8route.errors import Fp8InputError

log = logging.getLogger("fp8route")

# NVLink multicast (NVLS) can take a host's GPUs out of service; fp8route never asks for it.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

METHODS = ("auto", "symm_mem", "nccl")
ONE_SHOT_BYTES = 512 * 1024  # up to here the one-shot all-reduce beats NCCL on two H200s


def keep_multicast_off() -> None:
    """Set MULTICAST_OFF in this process's environment where the user has not set them."""
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)


class AllReduce:
    """Sums a tensor over the default group, returning the sum (the input is left unchanged when
    the peer-memory path runs, overwritten when NCCL runs).

    method "auto" uses the one-shot peer-memory all-reduce for messages up to one_shot_bytes
    when this is CUDA and symmetric memory sets up, else NCCL; "symm_mem" makes a failed set-up
    an error; "nccl" never tries it. Every rank must construct it at the same point (the set-up
    is collective)."""

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        one_shot_bytes: int,
        method: str = "auto",
        *,
        strict: bool = False,
    ) -> None:
        if method not in METHODS:
            raise Fp8InputError(f"all-reduce method must be one of {', '.join(METHODS)}, got {method!r}")
        self.method = "nccl"
        self.reason = "not a CUDA device" if device.type != "cuda" else "asked for nccl"
        self._buffer: torch.Tensor | None = None
        self._group_name = ""
        self._one_shot_numel = one_shot_bytes // torch.empty((), dtype=dtype).element_size()
        if device.type == "cuda" and method != "nccl":
            try:
                self._buffer, self._group_name = _symmetric_buffer(device, dtype, self._one_shot_numel)
                self.method, self.reason = "symm_mem", f"one-shot up to {one_shot_bytes} bytes, NCCL above"
            except (RuntimeError, AttributeError, ImportError) as exc:
                self.reason = f"symmetric memory unavailable ({type(exc).__name__}: {str(exc).splitlines()[0]})"
                if method == "symm_mem" or strict:
                    raise Fp8InputError(f"all-reduce: {self.reason}; use method 'nccl'") from exc
                log.warning("fp8route: all-reduce falls back to NCCL: %s", self.reason)

    def describe(self) -> str:
        return f"{self.method} ({self.reason})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._buffer is not None and x.numel() <= self._one_shot_numel and x.is_contiguous():
            symm = self._buffer[: x.numel()].view(x.shape)
            return torch.ops.symm_mem.one_shot_all_reduce_copy(symm, x, "sum", self._group_name)
        dist.all_reduce(x)
        return x


def _symmetric_buffer(device: torch.device, dtype: torch.dtype, numel: int) -> tuple[torch.Tensor, str]:
    import torch.distributed._symmetric_memory as symm_mem

    keep_multicast_off()
    group_name = dist.group.WORLD.group_name  # type: ignore[union-attr]
    buffer = symm_mem.empty(numel, dtype=dtype, device=device)
    symm_mem.rendezvous(buffer, group_name)
    return buffer, group_name
