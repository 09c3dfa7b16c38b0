"""Ranks of the fused all-reduce + residual add + RMSNorm (fp8route.kernels.peer_reduce) emulated in
one process, for its tests on a GPU and under Triton's interpreter: each rank's buffer, the flags and
slots a sender fills in it (the layout the module states), and every rank's kernel run in rank order."""

from __future__ import annotations

import torch

from fp8route.kernels.fused import rms_norm_reference
from fp8route.kernels.peer_reduce import PHASES, buffer_bytes, push_add_rms_norm

EPS = 1e-5


def ranks(
    world: int, rows_max: int, width: int, dtype: torch.dtype, device: str
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each rank's zeroed buffer, and the int64 tensor of their addresses the kernel reads."""
    size = buffer_bytes(world, rows_max, width, dtype)
    buffers = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(world)]
    return buffers, torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=device)


def flag_bytes(world: int, rows_max: int) -> int:
    return PHASES * world * rows_max * 4


def slot(buffer: torch.Tensor, world: int, phase: int, sender: int, rows_max: int, width: int,
         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The flags [rows_max] and slot [rows_max, width] that `sender` fills in this buffer: int32 flags
    [phase][sender][row] first, then the slots from the next 128-byte line on."""
    flags = flag_bytes(world, rows_max)
    data = buffer[(flags + 127) // 128 * 128 :].view(dtype).view(PHASES, world, rows_max, width)
    return buffer[:flags].view(torch.int32).view(PHASES, world, rows_max)[phase, sender], data[phase, sender]


def expected(
    partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, total): the partials summed in fp32 in rank order and rounded, plus the residual, normalized."""
    reduced = sum(p.float() for p in partials).to(residual.dtype)
    total = reduced + residual
    return rms_norm_reference(total, weight, EPS), total


def in_rank_order(partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                  buffers: list[torch.Tensor], addresses: torch.Tensor, rows_max: int,
                  phase: int) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Every rank's call, rank 0 first, each on its own partial: a rank finds the pushes of the ranks
    after it already in its buffer (written here, as if they had run first) and those of the ranks
    before it written by their kernels. Afterwards each push must sit where its receiver reads it; the
    flags a rank waited on must be down, and those that a later rank raised again in an earlier one's
    buffer (nobody waits for them) are lowered here."""
    world, (rows, width) = len(partials), residual.shape
    for rank in range(world):
        for sender in range(rank + 1, world):
            flag, data = slot(buffers[rank], world, phase, sender, rows_max, width, residual.dtype)
            data[:rows].copy_(partials[sender])
            flag[:rows].fill_(1)
    outs = [push_add_rms_norm(partials[r], residual, weight, EPS, addresses, r, rows_max, phase) for r in range(world)]
    if residual.is_cuda:
        torch.cuda.synchronize()
    for rank in range(world):
        for sender in set(range(world)) - {rank}:
            flag, data = slot(buffers[rank], world, phase, sender, rows_max, width, residual.dtype)
            assert torch.equal(data[:rows], partials[sender]), (rank, sender)
            assert bool((flag[:rows] == int(sender > rank)).all()), (rank, sender, flag[:rows].tolist())
            flag.zero_()
    return outs
