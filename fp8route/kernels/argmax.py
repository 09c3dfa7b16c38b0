"""Each row's greedy token: argmax over the vocabulary in two short Triton kernels on CUDA.

torch's argmax reduces a row of logits in one block: on the H200 a decode step's argmax over
Llama-3's 128256 logits took 36 us at batch 1 (1.2% of the step, for a 256 KB read), where its
bytes take well under one. Here the first kernel takes the maximum of each 2048-logit chunk of a
row with as many programs as the row has chunks, and the second picks each row's first maximal
chunk: the first index of the row's maximum, as torch.argmax gives it (a NaN counts as +inf).
"""

from __future__ import annotations

import torch

from fp8route.kernels.launcher import DirectLauncher
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR, tl, triton

_CHUNK = 2048
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax(logits, -1) for logits [B, V]: int64 [B]."""
    if not (logits.is_cuda and TRITON_IMPORT_ERROR is None and logits.dim() == 2 and logits.dtype in _DTYPES):
        return logits.argmax(-1)
    if logits.stride(-1) != 1 or logits.numel() == 0 or torch.compiler.is_compiling():
        return logits.argmax(-1)
    return argmax_rows(logits)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The kernels' path of greedy_tokens (on a CPU under Triton's interpreter too)."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, _CHUNK)
    values = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    indices = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    args = (logits, values, indices, logits.stride(0), vocab, chunks)
    _CHUNK_MAX((rows, chunks), (logits.dtype, logits.stride(0), vocab), args, _CHUNK_META)
    pad = triton.next_power_of_2(chunks)
    _ROW_MAX((rows,), (chunks,), (values, indices, out, chunks), {"PAD": pad, "num_warps": 1})
    return out


if TRITON_IMPORT_ERROR is None:
    from fp8route.kernels.pdl import wait_for_inputs

    @triton.jit
    def _chunk_max_kernel(
        x_ptr, val_ptr, idx_ptr, stride_row, vocab, chunks, CHUNK: tl.constexpr, USE_PDL: tl.constexpr
    ):
        wait_for_inputs(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * stride_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)  # NaN: the largest, as torch.argmax has it
        best, where = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(val_ptr + row * chunks + chunk, best)
        tl.store(idx_ptr + row * chunks + chunk, chunk * CHUNK + where)

    @triton.jit
    def _row_max_kernel(val_ptr, idx_ptr, out_ptr, chunks, PAD: tl.constexpr, USE_PDL: tl.constexpr):
        wait_for_inputs(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, PAD)
        values = tl.load(val_ptr + row * chunks + offs, mask=offs < chunks, other=float("-inf"))
        # The first chunk holding the maximum holds its first index: chunks are in index order.
        _, first = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(out_ptr + row, tl.load(idx_ptr + row * chunks + first).to(tl.int64))

    _CHUNK_MAX = DirectLauncher(_chunk_max_kernel, pointers=3, pdl=True)
    _ROW_MAX = DirectLauncher(_row_max_kernel, pointers=3, pdl=True)
    _CHUNK_META = {"CHUNK": _CHUNK, "num_warps": 4}
