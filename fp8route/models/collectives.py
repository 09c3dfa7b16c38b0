"""The all-reduce a row-parallel layer ends with, picked once per model at load time.

"nccl" (the default) is dist.all_reduce: NCCL on GPUs, gloo on CPUs. "symm_mem" sends messages up
to ONE_SHOT_BYTES through a one-shot all-reduce over peer memory instead (each rank copies its
partial into a buffer every rank can address, one barrier, then each rank reads all partials over
NVLink and sums them: one small kernel), PyTorch's `torch.ops.symm_mem.one_shot_all_reduce_copy`,
which runs without NVLink multicast (kept off: MULTICAST_OFF); larger messages still go to NCCL.
On two H200s it makes a batch-1 decode step ~3% faster but a 4096-token prefill ~20% slower,
though the prefill's messages go to NCCL either way (benchmarks/results/h200/tp2/), so it is an
option, not the default.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fp8route.errors import Fp8InputError

# NVLink multicast (NVLS) can take a host's GPUs out of service; fp8route never asks for it.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

METHODS = ("nccl", "symm_mem")
ONE_SHOT_BYTES = 512 * 1024  # up to here the one-shot all-reduce beats NCCL on two H200s


def check_method(method: str) -> None:
    if method not in METHODS:
        raise Fp8InputError(f"all-reduce method must be one of {', '.join(METHODS)}, got {method!r}")


def keep_multicast_off() -> None:
    """Set MULTICAST_OFF in this process's environment where the user has not set them."""
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)


class AllReduce:
    """Sums a tensor over the default group, returning the sum (the input is left unchanged when
    the peer-memory path runs, overwritten when NCCL runs).

    method "symm_mem" on CUDA sets up the one-shot path for messages up to one_shot_bytes (a
    collective: every rank constructs it at the same point), an error when it cannot; on a CPU it
    is NCCL's (gloo's) path with the reason said. "nccl" never tries it."""

    def __init__(self, device: torch.device, dtype: torch.dtype, one_shot_bytes: int, method: str = "nccl") -> None:
        check_method(method)
        self.method = "nccl"
        self.reason = "asked for nccl" if method == "nccl" else "not a CUDA device"
        self._buffer: torch.Tensor | None = None
        self._group_name = ""
        self._one_shot_numel = one_shot_bytes // torch.empty((), dtype=dtype).element_size()
        if device.type == "cuda" and method == "symm_mem":
            try:
                self._buffer, self._group_name = _symmetric_buffer(device, dtype, self._one_shot_numel)
            except (RuntimeError, AttributeError, ImportError) as exc:
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                raise Fp8InputError(f"all-reduce symm_mem: symmetric memory unavailable ({reason}); use nccl") from exc
            self.method, self.reason = "symm_mem", f"one-shot up to {one_shot_bytes} bytes, NCCL above"

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
