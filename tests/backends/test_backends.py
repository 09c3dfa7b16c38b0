"""Every backend's call on the CPU (torch._scaled_mm runs there too) against fp32 math."""

import pytest
import torch
from helpers import CPU_ROWWISE, fp32_reference, poison_allocator, random_fp8_operands, rel_error
from torch import nn

from fp8route import BACKENDS, DeviceInfo, Fp8Linear, GemmProblem, Policy, sqnr_db
from fp8route.quant import quantize

SHAPES = [(32, 64), (48, 256), (128, 1024), (96, 80)]
MS = [1, 17, 33, 129, 1000]


def make_layer(ops: dict[str, torch.Tensor], bias: bool) -> Fp8Linear:
    """A layer planned as if for an H200, so every scale layout exists while the tensors stay on the CPU."""
    layer = Fp8Linear(ops["weight"], ops["weight_scale"], ops["input_scale"], ops["bias"] if bias else None)
    layer.replan(device=DeviceInfo.fake_cuda(9, 0), policy=Policy(force="rowwise"))
    return layer


@pytest.mark.parametrize("name", ["reference", "cublas", "cublas_fast", pytest.param("rowwise", marks=CPU_ROWWISE)])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", MS)
def test_fp8_backends_match_fp32_math_on_cpu(name, n, k, m):
    ops = random_fp8_operands(m, n, k, seed=m * 7 + n)
    layer = make_layer(ops, bias=True)
    expected = fp32_reference(ops["x"], ops["weight"], ops["weight_scale"], ops["input_scale"], ops["bias"])
    poison_allocator(m * n, "cpu")
    out = BACKENDS[name].run(ops["x"], layer.operands())
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert not out.isnan().any()
    # fp32 output: only the summation order differs from the reference.
    assert rel_error(out, expected) < 1e-5


# rowwise writes bfloat16 only, and the planner never picks it for float16.
@pytest.mark.parametrize(
    ("name", "dtype"),
    [(b, d) for b in ("reference", "cublas") for d in (torch.bfloat16, torch.float16)]
    + [pytest.param("rowwise", torch.bfloat16, marks=CPU_ROWWISE)],
)
def test_low_precision_outputs_round_once(name, dtype):
    ops = random_fp8_operands(33, 64, 256, seed=3)
    layer = make_layer(ops, bias=True)
    expected = fp32_reference(ops["x"].to(dtype), ops["weight"], ops["weight_scale"], ops["input_scale"], ops["bias"])
    out = BACKENDS[name].run(ops["x"].to(dtype), layer.operands())
    assert out.dtype == dtype
    # One rounding to the output dtype: bf16 keeps 8 bits, fp16 11.
    assert rel_error(out, expected) < (4e-3 if dtype == torch.bfloat16 else 5e-4)


def test_weight_only_matches_float_math_without_activation_quantization():
    ops = random_fp8_operands(17, 64, 256, seed=5)
    layer = make_layer(ops, bias=True)
    x = ops["x"].to(torch.bfloat16)
    expected = x.float() @ (ops["weight"].float() * ops["weight_scale"]).t() + ops["bias"]
    assert rel_error(BACKENDS["weight_only"].run(x, layer.operands()), expected) < 1e-2


def test_dynamic_input_scale_uses_the_amax_of_each_x():
    ops = random_fp8_operands(9, 32, 64, seed=1)
    layer = Fp8Linear(ops["weight"], ops["weight_scale"], None)
    x = ops["x"] * 10
    expected = fp32_reference(x, ops["weight"], ops["weight_scale"], x.abs().max() / 448, None)
    assert rel_error(layer(x), expected) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_is_close_to_the_float_linear_on_gaussian_data(dtype):
    torch.manual_seed(0)
    linear = nn.Linear(512, 256).to(dtype)
    x = torch.randn(4, 33, 512, dtype=dtype)
    calib = x.abs().max().item() / 448
    for input_scale in (calib, None):
        layer = Fp8Linear.from_float(linear, input_scale=input_scale)
        out = layer(x)
        assert out.shape == (4, 33, 256) and out.dtype == dtype
        assert sqnr_db(linear(x).detach().float(), out.float()) >= 25


def test_leading_dims_and_empty_batches():
    layer = Fp8Linear.from_float(nn.Linear(64, 32))
    assert layer(torch.randn(2, 3, 4, 64)).shape == (2, 3, 4, 32)
    assert layer(torch.randn(0, 64)).shape == (0, 32)


def test_forced_reference_and_plan_agree_with_forward():
    torch.manual_seed(1)
    layer = Fp8Linear.from_float(nn.Linear(64, 32), input_scale=0.01, policy=Policy(force="reference"))
    x = torch.randn(5, 64)
    assert layer.plan.backend_for(5, torch.float32).name == "reference"
    assert torch.equal(layer(x), BACKENDS["reference"].run(x, layer.operands()))


@pytest.mark.parametrize("name", ["reference", "cublas", "cublas_fast", pytest.param("rowwise", marks=CPU_ROWWISE)])
def test_run_is_quantize_then_run_quantized(name):
    ops = random_fp8_operands(17, 48, 256, seed=3)
    layer = make_layer(ops, bias=True)
    x_q = quantize(ops["x"], layer.input_scale)
    expected = BACKENDS[name].run(ops["x"], layer.operands())
    assert torch.equal(BACKENDS[name].run_quantized(x_q, layer.input_scale, layer.operands(), torch.float32), expected)


def test_forward_quantized_routes_like_forward_and_keeps_leading_dims():
    ops = random_fp8_operands(6, 48, 256, seed=4)
    layer = Fp8Linear(ops["weight"], ops["weight_scale"], ops["input_scale"], ops["bias"])
    x = ops["x"].to(torch.bfloat16).reshape(2, 3, 256)
    x_q = quantize(x, layer.input_scale)
    out = layer.forward_quantized(x_q, torch.bfloat16)
    assert out.shape == (2, 3, 48) and out.dtype == torch.bfloat16
    assert torch.equal(out, layer(x))
    assert layer.forward_quantized(x_q[:0], torch.float16).shape == (0, 3, 48)


def test_forward_quantized_refuses_what_it_cannot_trust():
    ops = random_fp8_operands(4, 48, 256, seed=5)
    static = Fp8Linear(ops["weight"], ops["weight_scale"], ops["input_scale"], name="layers.0.o_proj")
    dynamic = Fp8Linear(ops["weight"], ops["weight_scale"], None, name="layers.0.down_proj")
    x_q = quantize(ops["x"], static.input_scale)
    with pytest.raises(ValueError, match="layers.0.down_proj: forward_quantized needs a static input_scale"):
        dynamic.forward_quantized(x_q)
    with pytest.raises(TypeError, match="layers.0.o_proj: forward_quantized takes float8_e4m3fn x, got torch.float32"):
        static.forward_quantized(ops["x"])
    with pytest.raises(TypeError, match="out_dtype must be"):
        static.forward_quantized(x_q, torch.int8)
    with pytest.raises(ValueError, match="K=256"):
        static.forward_quantized(x_q[:, :128])


@pytest.mark.parametrize(("n", "k", "refused"), [(512, 256, True), (192, 576, True), (6144, 4096, False)])
def test_cublas_block_takes_whole_blocks_four_to_a_scale_row(n, k, refused):
    """torch 2.11 refused cuBLASLt's block recipe at K=256 (two K blocks: the K-major scales' stride
    padded to four read as wrong) on an H100; K a multiple of 512 is read alike by every torch."""
    problem = GemmProblem(n, k, DeviceInfo.fake_cuda(9, 0), static_input_scale=False, scheme="block")
    reason = BACKENDS["cublas_block"].why_not(problem) or ""
    assert ("of 512 (whole blocks, 4 to a scale row)" in reason) == refused, reason


@pytest.mark.parametrize(
    ("device", "refused"),
    [
        (DeviceInfo.fake_cuda(9, 0), False),
        (DeviceInfo.fake_cuda(10, 0), False),
        (DeviceInfo.fake_cuda(8, 9), True),
    ],
)
def test_a_tiling_that_loads_through_tma_is_planned_only_where_the_gpu_has_it(device, refused):
    """By pointer loads triton_fixed_large's accumulators spill (many times slower): a GPU without TMA
    never plans it, and explain says why."""
    reason = BACKENDS["triton_fixed_large"].why_not(GemmProblem(4096, 4096, device)) or ""
    assert ("through TMA" in reason) == refused, reason
    assert "through TMA" not in (BACKENDS["triton_fixed_wide"].why_not(GemmProblem(4096, 4096, device)) or "")
