"""All-reduce, residual add and RMSNorm in one kernel over memory every rank can address.

A row-parallel layer's partial sums are followed by an all-reduce, the residual add and the next
RMSNorm: at decode two kernels and a barrier per layer half. Here each rank's kernel writes its
partial rows into every peer's buffer over NVLink, raises one flag per row in each peer's buffer,
waits for the peers' flags in its own, then sums the partials (in rank order, so every rank gets the
same bits), adds the residual and normalizes: one launch, one flag exchange, no reads over NVLink.

Each rank's buffer (PyTorch symmetric memory, or any memory the kernel can address on every rank)
holds, for two phases, an int32 flag per (sender, row) and a slot of `width` values per (sender,
row). A waiting flag is set back to 0 by the rank that waited on it. Two consecutive calls use
different phases, so a call never writes the slots or flags a peer may still be reading from the
call before: a rank reaches call n + 2 only after its peers raised their flags of call n + 1, which
they do after finishing call n. That argument needs each rank's calls in stream order (no
programmatic dependent launch, no second stream) and every rank making the same calls; any other
collective between two calls of one phase serves as well. A decoder layer gives its o_proj sum phase
0 and its down_proj sum phase 1, which alternate by construction, in eager steps and graph replays.
A rank whose peer never arrives waits forever, as in any collective; every program (one per row,
64 at most) must be resident at once on every rank, which a GPU of tens of SMs always allows.
"""

from __future__ import annotations

import functools

import torch

from fp8route.errors import Fp8InputError
from fp8route.kernels.launcher import DirectLauncher
from fp8route.kernels.triton_support import tl, triton

PHASES = 2


def buffer_bytes(world: int, rows: int, width: int, dtype: torch.dtype) -> int:
    """The size of each rank's buffer for up to `rows` rows of `width` values."""
    return _data_offset(world, rows) + PHASES * world * rows * width * dtype.itemsize


def _data_offset(world: int, rows: int) -> int:
    flags = PHASES * world * rows * 4
    return (flags + 127) // 128 * 128  # the slots start on a 128-byte line


def push_add_rms_norm(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    buffers: torch.Tensor,
    rank: int,
    rows_max: int,
    phase: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum_ranks(partial) + residual), sum_ranks(partial) + residual) for partial and
    residual [rows, width] (contiguous, 16-bit, rows <= rows_max), every rank calling with its own
    partial, the same residual and the same phase; `buffers` is an int64 tensor on this device of
    each rank's buffer address (buffer_bytes each, flags zero before the first call). The sum over
    ranks is rounded to partial's dtype before the residual is added, as an all-reduce then
    add_rms_norm would round it."""
    rows, width = partial.shape
    if not (
        residual.shape == partial.shape
        and residual.dtype == partial.dtype
        and partial.is_contiguous()
        and residual.is_contiguous()
        and rows <= rows_max
        and phase in range(PHASES)
    ):
        raise Fp8InputError(
            f"push_add_rms_norm: partial and residual must be contiguous [rows <= {rows_max}, width] of one "
            f"dtype and phase 0 or 1, got {tuple(partial.shape)} {partial.dtype}, {tuple(residual.shape)} "
            f"{residual.dtype}, phase {phase}"
        )
    return launch(partial, residual, weight, eps, buffers, rank, rows_max, phase)


def launch(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    buffers: torch.Tensor,
    rank: int,
    rows_max: int,
    phase: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """push_add_rms_norm without its checks, for a caller that has made them (once per model or per call)."""
    rows, width = partial.shape
    world = buffers.numel()
    out = torch.empty_like(partial)
    total = torch.empty_like(partial)
    args = (partial, residual, weight, out, total, buffers, width, eps, phase, _data_offset(world, rows_max))
    key = (partial.dtype, weight.dtype, width, eps, phase, rank, world, rows_max)
    _PUSH((rows,), key, args, _meta(rank, world, rows_max, width))
    return out, total


@functools.cache  # one dict per layout, not one per call
def _meta(rank: int, world: int, rows_max: int, width: int) -> dict[str, int]:
    return {"RANK": rank, "WORLD": world, "ROWS_MAX": rows_max, "BLOCK": triton.next_power_of_2(width), "num_warps": 4}


if triton is not None:
    from fp8route.kernels.fused import normalize_and_store

    @triton.jit
    def _push_add_rms_norm_kernel(
        x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, buffers_ptr, width, eps, phase, data_offset,
        RANK: tl.constexpr, WORLD: tl.constexpr, ROWS_MAX: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < width
        x = tl.load(x_ptr + row * width + offs, mask=mask, other=0.0)
        # This rank's slot and flag in every peer's buffer: [phase][RANK][row].
        mine = (phase * WORLD + RANK) * ROWS_MAX + row
        for p in tl.static_range(WORLD):
            if p != RANK:
                base = tl.load(buffers_ptr + p)
                slot = (base + data_offset).to(tl.pointer_type(x_ptr.dtype.element_ty)) + mine * width
                tl.store(slot + offs, x, mask=mask)
        # Every thread's slot writes before the flags that release them.
        tl.debug_barrier()
        for p in tl.static_range(WORLD):
            if p != RANK:
                flags = tl.load(buffers_ptr + p).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(flags + mine, 1, sem="release", scope="sys")
        own = tl.load(buffers_ptr + RANK)
        own_flags = own.to(tl.pointer_type(tl.int32))
        own_data = (own + data_offset).to(tl.pointer_type(x_ptr.dtype.element_ty))
        for p in tl.static_range(WORLD):
            if p != RANK:
                theirs = (phase * WORLD + p) * ROWS_MAX + row
                while tl.atomic_cas(own_flags + theirs, 1, 0, sem="acquire", scope="sys") != 1:
                    pass
        tl.debug_barrier()
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for p in tl.static_range(WORLD):  # rank order: the same sum on every rank
            if p == RANK:
                acc += x.to(tl.float32)
            else:
                theirs = (phase * WORLD + p) * ROWS_MAX + row
                part = tl.load(own_data + theirs * width + offs, mask=mask, other=0.0, cache_modifier=".cg")
                acc += part.to(tl.float32)
        reduced = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        r = tl.load(r_ptr + row * width + offs, mask=mask, other=0.0).to(tl.float32)
        total = (reduced + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * width + offs, total, mask=mask)
        normalize_and_store(total.to(tl.float32), w_ptr, out_ptr + row * width, offs, mask, width, eps)

    _PUSH = DirectLauncher(_push_add_rms_norm_kernel, pointers=6)
