"""The fused all-reduce + residual add + RMSNorm kernel under Triton's interpreter on a CPU
(TRITON_INTERPRET=1, with the triton extra), two and three ranks emulated in one process: the "peer"
buffers are CPU tensors whose addresses the kernel reads, as it reads symmetric memory on a GPU.
The interpreter runs one call at a time, so the ranks run in rank order, each finding the later
ranks' pushes already in its buffer (peer_cases.in_rank_order). Every rank must get the same bits:
the partials summed in rank order and rounded, plus the residual, normalized with the weight; each
push lands where its receiver reads it, and the flags a rank waited on come down.
test_peer_reduce_gpu.py runs the kernel on a GPU, two ranks at once.

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_peer_reduce_interpreted.py
"""

from __future__ import annotations

import os

import pytest
import torch
from peer_cases import expected, flag_bytes, in_rank_order, ranks

from fp8route.kernels.peer_reduce import PHASES
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1" or TRITON_IMPORT_ERROR is not None or torch.cuda.is_available(),
        reason="Triton's interpreter on a CPU: needs triton and TRITON_INTERPRET=1 (on a GPU, its _gpu test covers it)",
    ),
]


# fp16 only: the interpreter computes in numpy, which has no bfloat16. A width of 96 leaves a masked
# tail in the kernel's 128-wide row block.
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("rows", "rows_max", "width"), [(1, 4, 64), (3, 8, 96)])
def test_every_rank_gets_the_sum_in_rank_order_plus_the_residual_normalized(world, rows, rows_max, width):
    g = torch.Generator().manual_seed(world * 100 + rows)
    buffers, addresses = ranks(world, rows_max, width, torch.float16, "cpu")
    weight = torch.randn(width, generator=g).half()  # not ones: a norm that drops the weight fails
    for call in range(2 * PHASES):  # each phase twice: its flags must be down again after the first
        partials = [torch.randn(rows, width, generator=g).half() for _ in range(world)]
        residual = (3 * torch.randn(rows, width, generator=g)).half()
        outs = in_rank_order(partials, residual, weight, buffers, addresses, rows_max, call % PHASES)
        normed, total = expected(partials, residual, weight)
        for rank, (got_normed, got_total) in enumerate(outs):
            assert torch.equal(got_total, total), rank
            torch.testing.assert_close(got_normed, normed, rtol=1e-2, atol=1e-2)
            assert torch.equal(got_normed, outs[0][0]), rank
    assert all(int(b[: flag_bytes(world, rows_max)].count_nonzero()) == 0 for b in buffers)
