"""Every backend against the fp32 reference on the GPU, on Llama-3.1-8B shapes."""

from __future__ import annotations

import pytest
import torch
from helpers import fp32_reference, poison_allocator, random_fp8_operands, rel_error
from torch import nn

from fp8route import BACKENDS, DeviceInfo, Fp8Linear, GemmProblem, Policy
from fp8route.quant import quantize

pytestmark = pytest.mark.gpu

LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
MS = [1, 16, 17, 128, 512, 2048, 8192]


def runnable(name: str, n: int, k: int, m: int, dtype: torch.dtype) -> str | None:
    return BACKENDS[name].why_not(GemmProblem(n, k, DeviceInfo.of("cuda"), out_dtype=dtype, m_max=m))


def gpu_layer(n: int, k: int, m: int, bias: bool, seed: int) -> tuple[Fp8Linear, dict[str, torch.Tensor]]:
    ops = random_fp8_operands(m, n, k, device="cuda", seed=seed)
    layer = Fp8Linear(ops["weight"], ops["weight_scale"], ops["input_scale"], ops["bias"] if bias else None)
    return layer, ops


@pytest.mark.parametrize(
    "name", ["cublas", "cublas_fast", "rowwise", "flashinfer", "fp8_gemv", "weight_only", "reference"]
)
@pytest.mark.parametrize(("n", "k"), LLAMA_8B)
@pytest.mark.parametrize("m", MS)
def test_backend_matches_fp32_reference(name, n, k, m):
    reason = runnable(name, n, k, m, torch.bfloat16)
    if name == "fp8_gemv" and m > 128:
        assert reason == "built for M <= 128"
        return
    if reason is not None and name == "flashinfer":
        pytest.skip(reason)  # an optional extra; the device run installs it from carried wheels
    assert reason is None, f"{name} cannot run {n}x{k} on this GPU: {reason}"
    layer, ops = gpu_layer(n, k, m, bias=True, seed=m + n)
    layer.replan(policy=Policy(force=name))
    x = ops["x"].to(torch.bfloat16)
    expected = fp32_reference(x, ops["weight"], ops["weight_scale"], ops["input_scale"], ops["bias"])
    poison_allocator(m * n, "cuda")
    out = layer(x)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert not out.isnan().any(), "some outputs were never written"
    if name == "weight_only":
        # x is not quantized on this path: compare with the float activations instead.
        expected = x.float() @ (ops["weight"].float() * ops["weight_scale"]).t() + ops["bias"]
        assert rel_error(out, expected) < 1e-2
    else:
        # bf16 output rounding (2^-9) dominates; fast accumulation adds a little at large K.
        assert rel_error(out, expected) < (8e-3 if name in ("cublas_fast", "flashinfer") else 5e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_output_dtypes(dtype):
    layer, ops = gpu_layer(4096, 4096, 33, bias=True, seed=1)
    x = ops["x"].to(dtype)
    expected = fp32_reference(x, ops["weight"], ops["weight_scale"], ops["input_scale"], ops["bias"])
    out = layer(x)
    assert out.dtype == dtype
    assert rel_error(out, expected) < 2e-3


@pytest.mark.parametrize(("n", "k"), [(4096, 4100), (4100, 4096), (1000, 1000)])
def test_unaligned_shapes_are_planned_onto_a_backend_that_runs_them(n, k):
    torch.manual_seed(0)
    linear = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear.from_float(linear, input_scale=0.01)
    chosen = {b.name for b in layer.plan.routes[torch.bfloat16]}
    assert chosen == {"weight_only"}
    assert layer.plan.fallbacks, "an unaligned layer on an FP8 GPU must show its fallback"
    x = torch.randn(17, k, device="cuda", dtype=torch.bfloat16)
    out = layer(x)
    assert rel_error(out, linear(x)) < 5e-2


def test_a_layer_moved_to_the_gpu_is_replanned():
    layer = Fp8Linear.from_float(nn.Linear(4096, 4096), input_scale=0.01)
    assert layer.plan.routes[torch.bfloat16][0].name == "cpu_dequant"
    layer.cuda()
    assert layer.plan.problem.device.type == "cuda"
    assert layer.plan.routes[torch.bfloat16][0].name not in {"cpu_dequant", "reference"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = Fp8Linear.from_float(nn.Linear(4096, 6144, bias=False).cuda().bfloat16(), input_scale=0.02)
        self.o = Fp8Linear.from_float(nn.Linear(4096, 4096, bias=False).cuda().bfloat16(), input_scale=0.02)
        self.gate_up = Fp8Linear.from_float(nn.Linear(4096, 28672, bias=False).cuda().bfloat16(), input_scale=0.02)
        self.down = Fp8Linear.from_float(nn.Linear(14336, 4096, bias=False).cuda().bfloat16(), input_scale=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.o(self.qkv(x)[..., :4096])
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return h + self.down(nn.functional.silu(gate) * up)


@pytest.mark.parametrize("m", [1, 16, 128])
def test_compile_and_cuda_graph_replay_equal_eager(m):
    model = Block()
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    eager = model(x)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(x), eager, rtol=2e-2, atol=2e-2)

    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model(static_x)  # warm-up outside capture: cuBLAS handles and workspaces
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = model(static_x)
    fresh = torch.randn_like(x)
    static_x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, model(fresh)), "graph replay must give eager's bits"


@pytest.mark.parametrize("name", ["cublas", "cublas_fast", "rowwise", "flashinfer", "fp8_gemv", "reference"])
@pytest.mark.parametrize("m", [1, 17, 2048])
def test_forward_quantized_is_forward_without_the_quantization(name, m):
    """x quantized upstream (as a fused norm or activation would) gives the very bits forward gives."""
    n, k = 4096, 4096
    reason = runnable(name, n, k, m, torch.bfloat16)
    if reason is not None:
        if name == "flashinfer" or (name == "fp8_gemv" and m > 128):
            pytest.skip(reason)
        raise AssertionError(f"{name} cannot run {n}x{k}: {reason}")
    layer, ops = gpu_layer(n, k, m, bias=True, seed=m + 5)
    layer.replan(policy=Policy(force=name))
    x = ops["x"].to(torch.bfloat16)
    assert layer.input_scale is not None
    x_q = quantize(x, layer.input_scale)
    assert torch.equal(layer.forward_quantized(x_q, torch.bfloat16).view(torch.int16), layer(x).view(torch.int16))
