"""cpu_dequant: the reference's numerics from a weight dequantized once, what a CPU plans by default."""

import pytest
import torch
from helpers import random_fp8_operands
from torch import nn

import fp8route
from fp8route import BACKENDS, DeviceInfo, Fp8Linear, Policy
from fp8route.quant import quantize

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# One rounding to the output dtype: an fp32 result that moved by a few ulps can round one output
# ulp away (bf16 keeps 8 bits, fp16 11, so one ulp is at most 2^-7 or 2^-10 of the value).
ONE_ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 0.0}
# cpu_dequant runs the reference's own fp32 GEMM on the same values, so the outputs are equal; the
# slack is for a BLAS that sums in another order for another buffer alignment: a few fp32 ulps of
# the output's scale.
FP32_SLACK = 2**-20


def assert_same_as_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    diff = (out.float() - ref.float()).abs()
    bound = ONE_ULP[dtype] * ref.float().abs() + FP32_SLACK * ref.float().abs().max()
    assert (diff <= bound).all(), f"{dtype}: max diff {diff.max().item():.3e}"


def cpu_layer(ops: dict[str, torch.Tensor], bias: bool, **kwargs: object) -> Fp8Linear:
    return Fp8Linear(ops["weight"], ops["weight_scale"], ops["input_scale"], ops["bias"] if bias else None, **kwargs)  # type: ignore[arg-type]


def test_a_cpu_plans_cpu_dequant_and_keeps_an_fp32_copy_of_the_e4m3_values():
    ops = random_fp8_operands(1, 48, 256, seed=2)
    layer = cpu_layer(ops, bias=False)
    assert {b.name for b in layer.plan.backends} == {"cpu_dequant"}
    copy = layer.prepared.weight_dequantized
    assert copy is not None and copy.dtype == torch.float32 and copy.shape == (48, 256)
    assert torch.equal(copy, ops["weight"].float())  # unscaled: e4m3 values are exact in fp32


def test_no_copy_where_the_plan_does_not_read_it():
    ops = random_fp8_operands(1, 48, 256, seed=2)
    layer = cpu_layer(ops, bias=False, policy=Policy(force="reference"))
    assert layer.prepared.weight_dequantized is None
    layer = cpu_layer(ops, bias=False, policy=Policy(disable=frozenset({"cpu_dequant", "cpu_tiles"})))
    assert {b.name for b in layer.plan.backends} == {"reference"} and layer.prepared.weight_dequantized is None
    layer.replan(device=DeviceInfo.fake_cuda(9, 0), policy=Policy())
    assert "cpu_dequant" not in {b.name for b in layer.plan.backends}
    assert layer.prepared.weight_dequantized is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 48, 256), (17, 96, 80), (129, 128, 1024)])
def test_outputs_are_the_reference_backends(dtype, bias, m, n, k):
    ops = random_fp8_operands(m, n, k, seed=m + n)
    layer = cpu_layer(ops, bias)
    x = ops["x"].to(dtype)
    ref = BACKENDS["reference"].run(x, layer.operands())
    assert_same_as_reference(layer(x), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_quantized_is_the_reference_backends(dtype):
    ops = random_fp8_operands(9, 64, 192, seed=5)
    layer = cpu_layer(ops, bias=True)
    x_q = quantize(ops["x"].reshape(3, 3, 192), layer.input_scale)
    assert layer.plan.backend_for(9, dtype, x_quantized=True).name == "cpu_dequant"
    ref = BACKENDS["reference"].run_quantized(x_q.reshape(9, 192), layer.input_scale, layer.operands(), dtype)
    assert_same_as_reference(layer.forward_quantized(x_q, dtype).reshape(9, 64), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_shards_and_a_dynamic_scale_match_the_reference(dtype):
    ops = random_fp8_operands(5, 96, 128, seed=9)
    widths = [64, 16, 16]  # q, k, v with scales of their own, requantized to the largest
    scales = [ops["weight_scale"] * f for f in (1.0, 0.5, 0.25)]
    fused = Fp8Linear.from_quantized(ops["weight"], scales, [ops["input_scale"]] * 3, logical_widths=widths)
    dynamic = Fp8Linear(ops["weight"], ops["weight_scale"], None, ops["bias"])
    x = ops["x"].to(dtype) * 3
    for layer in (fused, dynamic):
        assert layer.plan.backend_for(5, dtype).name == "cpu_dequant"
        assert_same_as_reference(layer(x), BACKENDS["reference"].run(x, layer.operands()), dtype)


def test_a_wrong_copy_would_fail_these_checks():
    """The bound above is tight enough to catch a bf16 copy (rounded outputs) or an unquantized x."""
    ops = random_fp8_operands(17, 96, 512, seed=1)
    layer = cpu_layer(ops, bias=False)
    ref = BACKENDS["reference"].run(ops["x"], layer.operands())
    x_q = quantize(ops["x"], layer.input_scale)
    bf16_copy = (x_q.bfloat16() @ ops["weight"].bfloat16().t()).float() * (layer.input_scale * layer.weight_scale)
    unquantized = ops["x"] @ (ops["weight"].float() * layer.weight_scale).t()
    for wrong in (bf16_copy, unquantized):
        with pytest.raises(AssertionError):
            assert_same_as_reference(wrong, ref, torch.float32)


def test_explain_shows_the_choice_and_the_memory_it_costs():
    torch.manual_seed(0)
    model = nn.Sequential(
        Fp8Linear.from_float(nn.Linear(256, 512), input_scale=0.02, name="up"),
        Fp8Linear.from_float(nn.Linear(512, 256), input_scale=0.02, name="down"),
    )
    text = model[0].plan.explain()
    assert "bfloat16, float16, float32: M 1+ -> cpu_dequant" in text
    # [512, 256]: 128 KiB of e4m3, 512 KiB as fp32.
    assert "fp32 copy of the weight 512.0 KiB (for cpu_dequant; the e4m3 weight is 128.0 KiB)" in text
    total = fp8route.explain(model).splitlines()[-1]
    assert total == "made at plan time, all 2 layers: 1.0 MiB (their e4m3 weights: 256.0 KiB)"
    for layer in model:
        layer.replan(policy=Policy(force="reference"))
    assert "made at plan time, per layer: nothing beyond the checkpoint's tensors" in model[0].plan.explain()
    assert fp8route.explain(model).splitlines()[-1].startswith("made at plan time, all 2 layers: nothing")


@pytest.mark.parametrize("static", [True, False])
def test_cpu_tiles_gives_a_row_the_same_bits_alone_and_in_any_batch(static: bool) -> None:
    """The deterministic mode's CPU backend: the reference's numbers, each row's bits whatever else
    shares the call; a dynamic per-tensor input scale is taken per token (a batch's amax would tie
    each row's codes to the others)."""
    ops = random_fp8_operands(40, 96, 256, seed=5)
    layer = cpu_layer(ops, bias=True, policy=Policy(deterministic=True))
    if not static:
        layer = Fp8Linear(ops["weight"], ops["weight_scale"], None, ops["bias"], policy=Policy(deterministic=True))
    assert {b.name for b in layer.plan.backends} == {"cpu_tiles"}
    x = ops["x"].bfloat16()
    alone = layer(x[7:8])
    for m in (2, 16, 17, 40):
        batch = x[:m].clone()
        batch[m // 2] = x[7]
        assert torch.equal(layer(batch)[m // 2], alone[0]), m
    if static:
        assert_same_as_reference(layer(x), BACKENDS["reference"].run(x, layer.prepared), torch.bfloat16)
    else:  # per token: each row as if it were alone under the dynamic per-tensor scale
        for row in (0, 13, 39):
            ref = Fp8Linear(ops["weight"], ops["weight_scale"], None, ops["bias"], policy=Policy(force="reference"))
            assert_same_as_reference(layer(x[row : row + 1]), ref(x[row : row + 1]), torch.bfloat16)
