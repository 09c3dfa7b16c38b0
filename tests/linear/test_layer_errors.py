"""Bad input is a ValueError or TypeError that names the tensor, what was expected and what came."""

import pytest
import torch
from torch import nn

from fp8route import Fp8InputError, Fp8Linear, Fp8TypeError
from fp8route.quant import quantize_per_tensor


@pytest.fixture
def qweight() -> torch.Tensor:
    return quantize_per_tensor(torch.randn(32, 64))[0]


def test_weight_must_be_e4m3(qweight):
    with pytest.raises(Fp8TypeError, match=r"down\.weight: expected dtype float8_e4m3fn, got torch.bfloat16"):
        Fp8Linear(qweight.to(torch.bfloat16), 1.0, name="down")
    with pytest.raises(Fp8TypeError, match="float8_e4m3fn, got torch.float8_e5m2"):
        Fp8Linear(qweight.to(torch.float8_e5m2), 1.0)
    with pytest.raises(Fp8InputError, match=r"expected a 2-D \[N, K\] weight, got shape \(32, 64, 1\)"):
        Fp8Linear(qweight.unsqueeze(-1), 1.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -0.5])
@pytest.mark.parametrize("which", ["weight_scale", "input_scale"])
def test_scales_must_be_finite_and_positive(qweight, which, bad):
    scales = {"weight_scale": 1.0, "input_scale": 1.0, which: torch.tensor(bad)}
    with pytest.raises(Fp8InputError, match=rf"o_proj\.{which}: a scale must be finite and > 0, got"):
        Fp8Linear(qweight, scales["weight_scale"], scales["input_scale"], name="o_proj")


def test_bias_shape_and_dtype(qweight):
    with pytest.raises(
        Fp8InputError, match=r"qkv\.bias: expected shape \(32,\) to match weight \[N=32, K=64\], got \(64,\)"
    ):
        Fp8Linear(qweight, 1.0, bias=torch.zeros(64), name="qkv")
    with pytest.raises(Fp8TypeError, match=r"qkv\.bias: expected bfloat16, float16 or float32, got torch.int64"):
        Fp8Linear(qweight, 1.0, bias=torch.zeros(32, dtype=torch.long), name="qkv")


def test_x_last_dim_and_dtype(qweight):
    layer = Fp8Linear(qweight, 1.0, 0.1, name="gate_up")
    with pytest.raises(Fp8InputError, match=r"gate_up: x's last dim must be K=64, got x of shape \(3, 65\)"):
        layer(torch.randn(3, 65))
    with pytest.raises(Fp8TypeError, match="gate_up: x must be bfloat16, float16 or float32, got torch.int32"):
        layer(torch.ones(3, 64, dtype=torch.int32))
    with pytest.raises(Fp8TypeError, match="float32, got torch.float8_e4m3fn"):
        layer(torch.ones(3, 64).to(torch.float8_e4m3fn))


def test_constructors_reject_wrong_types(qweight):
    with pytest.raises(Fp8TypeError, match="expected an nn.Linear or a weight tensor, got str"):
        Fp8Linear.from_float("linear")
    with pytest.raises(Fp8TypeError, match=r"weight: expected bfloat16, float16 or float32, got torch.float8_e4m3fn"):
        Fp8Linear.from_float(qweight)
    with pytest.raises(Fp8InputError, match="2 shard weight scales need logical_widths"):
        Fp8Linear.from_quantized(qweight, [1.0, 2.0], 1.0)
    with pytest.raises(Fp8InputError, match=r"logical widths \[16, 8\] must be positive and sum to N=32"):
        Fp8Linear.from_quantized(qweight, 1.0, 1.0, logical_widths=[16, 8])
    with pytest.raises(Fp8InputError, match=r"input_scale\[1\]: a scale must be finite and > 0"):
        Fp8Linear.from_quantized(qweight, [1.0, 2.0], [1.0, -1.0], logical_widths=[16, 16])


def test_fused_shards_keep_their_values_within_the_reported_error():
    torch.manual_seed(0)
    q_part, k_part = nn.Linear(64, 32, bias=False), nn.Linear(64, 16, bias=False)
    (qq, qs), (kq, ks) = quantize_per_tensor(q_part.weight.detach()), quantize_per_tensor(k_part.weight.detach() * 5)
    layer = Fp8Linear.from_quantized(torch.cat([qq, kq]), [qs, ks], [0.01, 0.02], logical_widths=[32, 16], name="qkv")
    assert layer.logical_widths == (32, 16)
    assert layer.input_scale.item() == pytest.approx(0.02)
    assert layer.weight_scale.item() == pytest.approx(max(qs.item(), ks.item()))
    assert 0 < layer.requant_error < 0.1


def test_a_0d_x_names_the_layer(qweight):
    layer = Fp8Linear(qweight, 1.0, 0.1, name="layers.3.o_proj")
    with pytest.raises(Fp8InputError, match=r"layers\.3\.o_proj: x's last dim must be K=64, got x of shape \(\)$"):
        layer(torch.tensor(1.0))
    with pytest.raises(Fp8InputError, match=r"layers\.3\.o_proj: x's last dim must be K=64, got x of shape \(\)$"):
        layer.forward_quantized(torch.tensor(1.0).to(torch.float8_e4m3fn))


def nan_bytes(qweight: torch.Tensor, *where: tuple[int, int]) -> torch.Tensor:
    w = qweight.clone()
    for row, col in where:
        w.view(torch.uint8)[row, col] = 0xFF  # -NaN: the sign bit does not make it a number
    return w


def test_from_quantized_refuses_nan_weights_and_nan_or_inf_bias(qweight):
    bad = nan_bytes(qweight, (0, 0), (31, 63))
    with pytest.raises(Fp8InputError, match=r"^layers\.0\.q_proj\.weight: 2 NaN value\(s\) in the FP8 weight$"):
        Fp8Linear.from_quantized(bad, 1.0, 1.0, name="layers.0.q_proj")
    with pytest.raises(Fp8InputError, match=r"^qkv\.weight: 2 NaN value\(s\)"):  # shards fused: checked before
        Fp8Linear.from_quantized(bad, [1.0, 2.0], [1.0, 1.0], logical_widths=[16, 16], name="qkv")
    for value in (float("nan"), float("inf")):
        bias = torch.zeros(32)
        bias[7] = value
        with pytest.raises(Fp8InputError, match=r"^qkv\.bias: 1 NaN or Inf value\(s\); expected finite values$"):
            Fp8Linear.from_quantized(qweight, 1.0, 1.0, bias, name="qkv")
    with pytest.raises(Fp8InputError, match=r"^qkv\.weight_scale: a scale must be finite and > 0, got nan$"):
        Fp8Linear.from_quantized(qweight, float("nan"), 1.0, name="qkv")
    with pytest.raises(Fp8InputError, match=r"^qkv\.input_scale\[1\]: a scale must be finite and > 0, got inf$"):
        Fp8Linear.from_quantized(qweight, 1.0, [1.0, float("inf")], name="qkv")
    assert Fp8Linear.from_quantized(nan_bytes(qweight), 1.0, 1.0, torch.zeros(32)).out_features == 32


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_quantizing_refuses_nan_and_inf(value):
    linear = nn.Linear(64, 32)
    with torch.no_grad():
        linear.weight[3, 4] = value
    with pytest.raises(Fp8InputError, match=r"^down\.weight: 1 NaN or Inf value\(s\); expected finite values$"):
        Fp8Linear.from_float(linear, name="down")
    with pytest.raises(Fp8InputError, match=r"^x: 1 NaN or Inf value\(s\)"):
        quantize_per_tensor(linear.weight.detach())
    with pytest.raises(Fp8InputError, match=r"^w: 1 NaN or Inf value\(s\)"):
        quantize_per_tensor(linear.weight.detach(), torch.tensor(0.01), name="w")
    with torch.no_grad():
        linear.weight[3, 4] = 0.0
        linear.bias[5] = value
    with pytest.raises(Fp8InputError, match=r"^down\.bias: 1 NaN or Inf value\(s\)"):
        Fp8Linear.from_float(linear, name="down")
