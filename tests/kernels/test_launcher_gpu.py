"""The direct launch path against Triton's own: same bits, a new compile wherever Triton would
specialize differently (alignment, integer values, dtypes), and inside CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from fp8route.kernels import launcher
from fp8route.kernels.decode_gemm import launch as decode_launch
from fp8route.kernels.decode_gemm.launch import decode_gemm
from fp8route.kernels.quantize import quantize_fp8
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or TRITON_IMPORT_ERROR is not None, reason="needs CUDA and triton"
)
FP8 = torch.float8_e4m3fn


class CountingFn:
    """A JITFunction stand-in that counts the launches going through Triton's own path."""

    def __init__(self, fn) -> None:  # type: ignore[no-untyped-def]
        self.fn, self.params, self.__name__, self.calls = fn, fn.params, fn.__name__, 0

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.fn[grid]


def operands(n: int, k: int, m: int, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 100).clamp(-448, 448).to(FP8)
    return x, w, torch.tensor(0.003, device="cuda"), torch.tensor(0.01, device="cuda")


@pytest.mark.gpu
@gpu
def test_second_call_skips_triton_and_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingFn(decode_launch._CUDA_CORE.fn)
    monkeypatch.setattr(decode_launch._CUDA_CORE, "fn", counting)
    monkeypatch.setattr(decode_launch._CUDA_CORE, "_compiled", {})  # whatever ran before in this process
    x, w, s_w, s_in = operands(4096, 4096, 1, seed=1)
    first = decode_gemm(x, w, s_w, s_in, None, torch.bfloat16)
    again = [decode_gemm(x, w, s_w, s_in, None, torch.bfloat16) for _ in range(3)]
    assert all(torch.equal(a, first) for a in again)
    assert counting.calls == (1 if launcher.DIRECT else 4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 16])
def test_misaligned_and_strided_x_recompile_and_match(m: int) -> None:
    n, k = 4096, 4096
    x, w, s_w, s_in = operands(n, k, m, seed=2)
    contiguous = decode_gemm(x, w, s_w, s_in, None, torch.bfloat16)
    # Rows 2 bytes off 16-byte alignment, then rows of stride K + 8: each a specialization Triton keys on.
    shifted = torch.empty(m * k + 1, device="cuda", dtype=torch.bfloat16)[1:].view(m, k)
    padded = torch.empty(m, k + 8, device="cuda", dtype=torch.bfloat16)[:, :k]
    for view in (shifted, padded):
        view.copy_(x)
        assert torch.equal(decode_gemm(view, w, s_w, s_in, None, torch.bfloat16), contiguous)
    assert torch.equal(decode_gemm(x, w, s_w, s_in, None, torch.bfloat16), contiguous)


@pytest.mark.gpu
@gpu
def test_quantizer_specializations_in_any_order() -> None:
    s = torch.tensor(0.02, device="cuda")
    base = torch.randn(4099, device="cuda").to(torch.bfloat16)
    for numel in (16, 1, 17, 4096, 15, 1, 4099, 32):
        for offset in (0, 1):
            x = base[offset : offset + numel]
            expected = (x.float() / s).clamp(-448, 448).to(FP8)
            assert torch.equal(quantize_fp8(x, s).view(torch.uint8), expected.view(torch.uint8)), (numel, offset)


@pytest.mark.gpu
@gpu
def test_direct_launches_are_captured_by_cuda_graphs() -> None:
    x, w, s_w, s_in = operands(6144, 4096, 1, seed=3)
    static_x = x.clone()
    decode_gemm(static_x, w, s_w, s_in, None, torch.bfloat16)
    quantize_fp8(static_x, s_in)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_gemm(static_x, w, s_w, s_in, None, torch.bfloat16)
        q = quantize_fp8(static_x, s_in)
    for seed in (4, 5):
        static_x.copy_(operands(6144, 4096, 1, seed=seed)[0])
        graph.replay()
        assert torch.equal(out, decode_gemm(static_x, w, s_w, s_in, None, torch.bfloat16))
        assert torch.equal(q.view(torch.uint8), quantize_fp8(static_x, s_in).view(torch.uint8))
