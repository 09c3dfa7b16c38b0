"""The greedy token kernels against torch.argmax: first index of the maximum (ties across and within
chunks), rows narrower than a chunk, Llama-3's vocabulary, every activation dtype, NaN as +inf.

On a CPU they run under Triton's interpreter:

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_argmax_gpu.py
"""

from __future__ import annotations

import os

import pytest
import torch

from fp8route.kernels import argmax

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.interpreter,
    pytest.mark.skipif(
        argmax.TRITON_IMPORT_ERROR is not None or not (torch.cuda.is_available() or INTERPRET),
        reason="needs triton, and CUDA or TRITON_INTERPRET=1",
    ),
]
# The interpreter computes in numpy, which has no bfloat16.
DTYPES = [torch.bfloat16, torch.float16, torch.float32] if torch.cuda.is_available() else [torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 128256), (16, 5000), (3, 7), (2, 2048)])
def test_random_rows_give_torch_argmax(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    logits = (torch.randn(shape, generator=g) * 4).to(DEVICE, dtype)
    assert torch.equal(argmax.argmax_rows(logits), logits.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ties_give_the_first_index_and_nan_counts_as_largest(dtype):
    logits = torch.zeros(5, 6000, dtype=dtype, device=DEVICE)
    logits[0, [4100, 70, 5999]] = 3.0  # across chunks: the first chunk's wins
    logits[1, [2050, 2049]] = 3.0  # within one chunk
    logits[2] = float("-inf")  # all -inf: index 0
    logits[3, [10, 4000]] = torch.tensor([5.0, float("nan")], dtype=dtype, device=DEVICE)
    logits[4, 5999] = 1.0  # in the last, partial chunk
    assert argmax.argmax_rows(logits).tolist() == [70, 2049, 0, 4000, 5999]


def test_a_strided_row_view_is_read_by_its_stride():
    logits = torch.randn(4, 3000, dtype=torch.float32, device=DEVICE)
    view = logits[:, :2500]
    assert torch.equal(argmax.argmax_rows(view), view.argmax(-1))
