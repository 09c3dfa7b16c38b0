"""fp8_gemv against an fp32/fp64 reference of the same quantized operands, and against cuBLASLt's error."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp8route.device import DeviceInfo
from fp8route.kernels.decode_gemm import configs
from fp8route.kernels.decode_gemm.launch import decode_gemm
from fp8route.kernels.quantize import quantize_fp8
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR


def choose_config(m: int, n: int, k: int) -> configs.DecodeConfig:
    """The configuration the kernel picks on this GPU."""
    return configs.choose_config(m, n, k, DeviceInfo.of("cuda"))


FP8 = torch.float8_e4m3fn
SHAPES = [  # (N, K): Llama-3.1-8B TP1 and TP4 projections, and one that needs every mask
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
    (1536, 4096), (4096, 1024), (7168, 4096), (4096, 3584),
    (208, 400),
]  # fmt: skip
MS = (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64)
OUT_DTYPES = (torch.bfloat16, torch.float16)

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or TRITON_IMPORT_ERROR is not None, reason="needs CUDA and triton"
)


def quantize_ref(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The standalone quantizer (fp8route.quant.quantize), written out so the test pins its rounding."""
    return (x.float() / s).clamp(-448, 448).to(FP8)


def make(n: int, k: int, m: int, out_dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, k, device="cuda", generator=g) * 2).to(out_dtype)
    s_in = (x.float().abs().amax() / 448 * 0.8).reshape(())  # a static scale with some saturation
    w = (torch.randn(n, k, device="cuda", generator=g) * 120).clamp(-448, 448).to(FP8)
    s_w = torch.tensor(0.0027, device="cuda")
    bias = torch.randn(n, device="cuda", generator=g).to(out_dtype) * 8
    return x, w, s_w, s_in, bias


def reference(q: torch.Tensor, w: torch.Tensor, s_w, s_in, bias) -> torch.Tensor:
    y = (q.float().double() @ w.float().double().T) * s_in.double() * s_w.double()
    return y + bias.double() if bias is not None else y


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def cublas(q, w, s_w, s_in, bias, out_dtype) -> torch.Tensor:
    try:
        return torch._scaled_mm(q, w.t(), s_in, s_w, bias=bias, out_dtype=out_dtype)
    except RuntimeError:  # per-tensor cuBLASLt without a bias epilogue for this dtype
        y = torch._scaled_mm(q, w.t(), s_in, s_w, out_dtype=torch.float32)
        return (y + bias.float() if bias is not None else y).to(out_dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("n,k", SHAPES, ids=lambda v: str(v))
def test_matches_reference(n: int, k: int, out_dtype: torch.dtype) -> None:
    failures = []
    for m in MS:
        x, w, s_w, s_in, bias = make(n, k, m, out_dtype, seed=m * 7 + n + k)
        q = quantize_ref(x, s_in)
        for b in (None, bias):
            ref = reference(q, w, s_w, s_in, b)
            err_cublas = rel_err(cublas(q, w, s_w, s_in, b, out_dtype), ref)
            for name, xin in (("fused", x), ("prequant", q)):
                out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
                decode_gemm(xin, w, s_w, s_in, b, out_dtype, out=out)
                err = rel_err(out, ref)
                ok = not out.isnan().any().item() and err <= max(2 * err_cublas, 1e-4) and err < 1e-2
                if not ok:
                    failures.append(f"M={m} bias={b is not None} {name}: err {err:.2e} cublas {err_cublas:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("block_m", [64, 16])  # 16: the 33 tokens in three token tiles per weight tile
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_fused_quantization_is_bit_identical(out_dtype: torch.dtype, block_m: int, split_k: int) -> None:
    # With w = identity and weight_scale = 1, out = e4m3(x / s) * s exactly, rounded once to out_dtype,
    # so any difference in the quantized value shows in the output bits.
    k = 1024
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(33, k, device="cuda", generator=g) * torch.logspace(-4, 1.5, k, device="cuda")
    x[0, :6] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e6, -1e6])
    x = x.to(out_dtype)
    s_in = torch.tensor(0.0371, device="cuda")  # not a power of two: division rounding matters
    w = torch.eye(k, device="cuda").to(FP8)
    one = torch.tensor(1.0, device="cuda")
    q = quantize_ref(x, s_in)
    expected = (q.float() * s_in).to(out_dtype)
    cfg = configs.DecodeConfig(128, 128, block_m, split_k, num_warps=8, num_stages=4)
    out = decode_gemm(x, w, one, s_in, None, out_dtype, config=cfg)
    # Compared by value: a matmul cannot return -0 (the accumulator starts at +0), so e4m3 -0 comes back as +0.
    bad = (out.float() != expected.float()).nonzero()
    assert bad.numel() == 0, f"{len(bad)} mismatches, first at {bad[:4].tolist()}: x={x[tuple(bad[0])].item()}"
    assert torch.equal(quantize_fp8(x, s_in).view(torch.uint8), q.view(torch.uint8))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k", [(1536, 4096), (208, 400)], ids=str)
@pytest.mark.parametrize("split_k", [1, 3])
def test_token_tiles_below_m_match_reference(n: int, k: int, split_k: int) -> None:
    failures = []
    for m in (17, 33, 63, 64):
        x, w, s_w, s_in, bias = make(n, k, m, torch.bfloat16, seed=m + n)
        ref = reference(quantize_ref(x, s_in), w, s_w, s_in, bias)
        for block_m in (16, 32):
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            decode_gemm(
                x,
                w,
                s_w,
                s_in,
                bias,
                torch.bfloat16,
                out=out,
                config=configs.DecodeConfig(128, 128, block_m, split_k, 8, 4),
            )
            err = rel_err(out, ref)
            if out.isnan().any().item() or err > 5e-3:
                failures.append(f"M={m} block_m={block_m}: err {err:.2e}")
    assert not failures, "\n".join(failures)


# The CUDA-core kernel's lane layouts (block_k 512: 32 lanes along K; 64: 4 along K x 8 rows; 256;
# 1024-2048: two to four 16-byte loads per lane and row), with and without cp.async staging
# (num_stages), with and without split-K, and under register caps (48 spills a little at 32x512):
# (block_n, block_k, num_warps, num_stages, split_k[, maxnreg]).
CUDA_CORE_BLOCKS = [
    (16, 512, 4, 1, 1), (16, 512, 4, 1, 4), (16, 512, 1, 3, 3), (128, 64, 4, 3, 4), (64, 256, 8, 1, 2),
    (32, 1024, 16, 1, 2), (16, 2048, 8, 1, 1), (16, 2048, 8, 1, 1, 80), (32, 512, 8, 1, 4, 48),
]  # fmt: skip


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("blocks", CUDA_CORE_BLOCKS, ids=str)
def test_cuda_core_kernel_matches_reference(blocks: tuple) -> None:
    block_n, block_k, warps, stages, split_k, *maxnreg = blocks
    failures = []
    for n, k in [(4096, 14336), (1536, 4096), (208, 400)]:
        for m in range(1, configs.CUDA_CORE_M_MAX + 1):
            out_dtype = OUT_DTYPES[m % 2]
            x, w, s_w, s_in, bias = make(n, k, m, out_dtype, seed=m * 5 + n)
            q = quantize_ref(x, s_in)
            ref = reference(q, w, s_w, s_in, bias)
            err_cublas = rel_err(cublas(q, w, s_w, s_in, bias, out_dtype), ref)
            block_m = 1 << (m - 1).bit_length()
            cfg = configs.DecodeConfig(block_n, block_k, block_m, split_k, warps, stages, True, *maxnreg)
            for name, xin in (("fused", x), ("prequant", q)):
                out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
                decode_gemm(xin, w, s_w, s_in, bias, out_dtype, out=out, config=cfg)
                err = rel_err(out, ref)
                if out.isnan().any().item() or err > max(2 * err_cublas, 1e-4) or err >= 1e-2:
                    failures.append(f"{n}x{k} M={m} {name}: err {err:.2e} cublas {err_cublas:.2e}")
                again = decode_gemm(xin, w, s_w, s_in, bias, out_dtype, config=cfg)
                if not torch.equal(again, out):
                    failures.append(f"{n}x{k} M={m} {name}: a repeat run gave other bits")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("split_k", [1, 4])
def test_cuda_core_fused_quantization_is_bit_identical(split_k: int) -> None:
    k, m = 1024, 5
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(m, k, device="cuda", generator=g) * torch.logspace(-4, 1.5, k, device="cuda")
    x[0, :6] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e6, -1e6])
    x = x.to(torch.bfloat16)
    s_in = torch.tensor(0.0371, device="cuda")
    w = torch.eye(k, device="cuda").to(FP8)
    one = torch.tensor(1.0, device="cuda")
    expected = (quantize_ref(x, s_in).float() * s_in).to(torch.bfloat16)
    cfg = configs.DecodeConfig(16, 512, 8, split_k, 1, 3, cuda_core=True)
    out = decode_gemm(x, w, one, s_in, None, torch.bfloat16, config=cfg)
    bad = (out.float() != expected.float()).nonzero()
    assert bad.numel() == 0, f"{len(bad)} mismatches, first at {bad[:4].tolist()}: x={x[tuple(bad[0])].item()}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 16, 64])
def test_repeat_runs_are_bit_identical(m: int) -> None:
    x, w, s_w, s_in, bias = make(4096, 14336, m, torch.bfloat16, seed=3)
    # The table's pick, and the same with split-K whatever the table says: the reduction is what could vary.
    split = dataclasses.replace(choose_config(m, 4096, 14336), split_k=4)
    for config in (None, split):
        first = decode_gemm(x, w, s_w, s_in, bias, torch.bfloat16, config=config)
        for _ in range(20):
            assert torch.equal(decode_gemm(x, w, s_w, s_in, bias, torch.bfloat16, config=config), first)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("m", [1, 8])
def test_cuda_graph_replay_equals_eager(fused: bool, m: int) -> None:
    # Both kernels with split-K (its counters must reset inside the graph), whatever the table picks.
    cuda_core = configs.DecodeConfig(
        block_n=32, block_k=512, block_m=1, split_k=4, num_warps=8, num_stages=1, cuda_core=True
    )
    wgmma = configs.DecodeConfig(block_n=256, block_k=128, block_m=16, split_k=8, num_warps=8, num_stages=4)
    config = cuda_core if m == 1 else wgmma
    n, k = 4096, 4096
    x, w, s_w, s_in, bias = make(n, k, m, torch.bfloat16, seed=5)
    static_x = (x if fused else quantize_ref(x, s_in)).clone()
    decode_gemm(static_x, w, s_w, s_in, bias, torch.bfloat16, config=config)  # compile, allocate counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = decode_gemm(static_x, w, s_w, s_in, bias, torch.bfloat16, config=config)
    for seed in range(3):
        x2 = make(n, k, m, torch.bfloat16, seed=100 + seed)[0]
        static_x.copy_(x2 if fused else quantize_ref(x2, s_in))
        graph.replay()
        eager = decode_gemm(static_x, w, s_w, s_in, bias, torch.bfloat16, config=config)
        assert torch.equal(static_out, eager)


@pytest.mark.gpu
@gpu
def test_rejects_bad_input() -> None:
    x, w, s_w, s_in, bias = make(256, 512, 4, torch.bfloat16, seed=9)
    with pytest.raises(ValueError, match="bias"):
        decode_gemm(x, w, s_w, s_in, bias.float(), torch.bfloat16)
    with pytest.raises(ValueError, match="M=129"):
        decode_gemm(torch.zeros(129, 512, dtype=torch.bfloat16, device="cuda"), w, s_w, s_in, None, torch.bfloat16)
    with pytest.raises(TypeError, match="out_dtype"):
        decode_gemm(x, w, s_w, s_in, None, torch.float32)
    with pytest.raises(ValueError, match="at most 2 tokens"):
        decode_gemm(
            x, w, s_w, s_in, None, torch.bfloat16, config=configs.DecodeConfig(64, 128, 2, 1, 4, 1, cuda_core=True)
        )


def test_why_not_reasons() -> None:
    if TRITON_IMPORT_ERROR is not None:
        assert configs.why_not(1, 4096, 4096) == TRITON_IMPORT_ERROR
        return
    assert configs.why_not(1, 4096, 4096) is None
    assert configs.why_not(128, 28672, 4096) is None
    assert configs.why_not(1, 4096, 4100) == "K=4100 is not a multiple of 16 (16-byte fp8 weight rows)"
    assert "M=129" in configs.why_not(129, 4096, 4096)
