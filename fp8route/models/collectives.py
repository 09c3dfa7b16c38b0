"""The all-reduce a row-parallel layer ends with, picked once per model at load time.

"nccl" (the default) is dist.all_reduce: NCCL on GPUs, gloo on CPUs. "symm_mem" sends messages up
to ONE_SHOT_BYTES through a one-shot all-reduce over peer memory instead (each rank copies its
partial into a buffer every rank can address, one barrier, then each rank reads all partials over
NVLink and sums them: one small kernel), PyTorch's `torch.ops.symm_mem.one_shot_all_reduce_copy`,
which runs without NVLink multicast (kept off: MULTICAST_OFF); larger messages still go to NCCL.
It makes a batch-1 decode step a little faster but a long prefill slower, though the prefill's
messages go to NCCL either way (the figures: docs/tensor-parallel.md), so it is an option, not the
default. "fused" is "symm_mem" whose all-reduces before a residual add and RMSNorm
(every one in a decoder layer) run with them as one kernel that pushes each rank's partial into its
peers' memory (fp8route.kernels.peer_reduce) for up to ONE_SHOT_BYTES of rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fp8route.errors import Fp8InputError
from fp8route.kernels import peer_reduce
from fp8route.kernels.fused import add_rms_norm

# NVLink multicast (NVLS) can take a host's GPUs out of service; fp8route never asks for it.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

METHODS = ("nccl", "symm_mem", "fused")
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

    method "symm_mem" or "fused" on CUDA sets up the one-shot path for messages up to
    one_shot_bytes (a collective: every rank constructs it at the same point), an error when it
    cannot; on a CPU it is NCCL's (gloo's) path with the reason said. "nccl" never tries it.
    "fused" also sets up add_rms_norm's one-kernel path for rows of `width` values."""

    def __init__(
        self, device: torch.device, dtype: torch.dtype, one_shot_bytes: int, method: str = "nccl", width: int = 0
    ) -> None:
        check_method(method)
        if method == "fused" and width <= 0:
            raise Fp8InputError("all-reduce fused: pass width, the hidden size its rows have")
        self.method = "nccl"
        self.reason = "the process group's own" if method == "nccl" else "not a CUDA device"
        self._buffer: torch.Tensor | None = None
        self._group_name = ""
        self._one_shot_numel = one_shot_bytes // dtype.itemsize
        self._push: _PushBuffers | None = None
        if device.type == "cuda" and method != "nccl":
            try:
                self._buffer, self._group_name = _symmetric_buffer(device, dtype, self._one_shot_numel)
                if method == "fused":
                    self._push = _PushBuffers.allocate(device, dtype, one_shot_bytes, width)
            except (RuntimeError, AttributeError, ImportError) as exc:
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                raise Fp8InputError(f"all-reduce {method}: symmetric memory unavailable ({reason}); use nccl") from exc
            self.method, self.reason = method, f"one-shot up to {one_shot_bytes} bytes, NCCL above"
            if self._push is not None:
                self.reason += f"; fused with the residual add and RMSNorm up to {self._push.rows} rows"

    def describe(self) -> str:
        # "nccl" is the process group's own all_reduce: gloo's on a CPU, and named as such.
        backend = dist.get_backend() if self.method == "nccl" and dist.is_initialized() else self.method
        return f"{backend} ({self.reason})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._buffer is not None and x.numel() <= self._one_shot_numel and x.is_contiguous():
            symm = self._buffer[: x.numel()].view(x.shape)
            return torch.ops.symm_mem.one_shot_all_reduce_copy(symm, x, "sum", self._group_name)
        dist.all_reduce(x)
        return x

    def add_rms_norm(
        self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, phase: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fused.add_rms_norm(sum over ranks of partial, residual, weight, eps), in one kernel
        where the "fused" path takes these rows. phase (0 or 1) must alternate between consecutive
        fused calls (fp8route.kernels.peer_reduce): a decoder layer's o_proj passes 0, its down_proj 1."""
        push = self._push
        if push is not None and push.takes(partial, residual):
            shape = partial.shape
            rows = partial.reshape(-1, shape[-1])
            normed, total = peer_reduce.launch(  # takes() made push_add_rms_norm's checks
                rows, residual.reshape(rows.shape), weight, eps, push.addresses, push.rank, push.rows, phase
            )
            return normed.view(shape), total.view(shape)
        return add_rms_norm(self(partial), residual, weight, eps)


@dataclass
class _PushBuffers:
    """Each rank's buffer for peer_reduce, and where every rank's is."""

    memory: torch.Tensor  # keeps this rank's buffer alive
    addresses: torch.Tensor  # int64 [world], on this device
    rank: int
    rows: int
    width: int
    dtype: torch.dtype
    handle: object  # the rendezvous: keeps the peers' mappings

    @classmethod
    def allocate(cls, device: torch.device, dtype: torch.dtype, one_shot_bytes: int, width: int) -> _PushBuffers:
        import torch.distributed._symmetric_memory as symm_mem

        rows = max(1, one_shot_bytes // (width * dtype.itemsize))
        world = dist.get_world_size()
        memory = symm_mem.empty(peer_reduce.buffer_bytes(world, rows, width, dtype), dtype=torch.uint8, device=device)
        memory.zero_()  # the flags start lowered
        handle = symm_mem.rendezvous(memory, dist.group.WORLD.group_name)  # type: ignore[union-attr]
        addresses = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        dist.barrier()  # every rank's flags lowered before any rank raises one
        torch.cuda.synchronize(device)
        return cls(memory, addresses, dist.get_rank(), rows, width, dtype, handle)

    def takes(self, partial: torch.Tensor, residual: torch.Tensor) -> bool:
        rows = partial.numel() // max(1, partial.shape[-1])
        return (
            partial.shape[-1] == self.width
            and rows <= self.rows
            and partial.dtype == residual.dtype == self.dtype
            and partial.is_contiguous()
            and residual.is_contiguous()
            and residual.shape == partial.shape
        )


def _symmetric_buffer(device: torch.device, dtype: torch.dtype, numel: int) -> tuple[torch.Tensor, str]:
    import torch.distributed._symmetric_memory as symm_mem

    keep_multicast_off()
    group_name = dist.group.WORLD.group_name  # type: ignore[union-attr]
    buffer = symm_mem.empty(numel, dtype=dtype, device=device)
    symm_mem.rendezvous(buffer, group_name)
    return buffer, group_name
