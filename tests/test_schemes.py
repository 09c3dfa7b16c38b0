"""The three FP8 schemes' reference numerics (fp8route.schemes) and Fp8Linear built in each."""

from __future__ import annotations

import pytest
import torch

from fp8route import Fp8Linear
from fp8route.errors import Fp8InputError
from fp8route.schemes import (
    dequantize_activation,
    dequantize_weight,
    expand_blocks,
    quantize_activation,
    quantize_weight,
    scaled_matmul,
    weight_scale_shape,
)

SHAPES = [(192, 576), (300, 200), (128, 256)]  # SmolLM2's partial blocks, odd edges, whole blocks


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_weight_round_trip_keeps_each_scale_group_within_e4m3_precision(scheme, n, k):
    w = torch.randn(n, k) * torch.logspace(-3, 0, n)[:, None]  # rows of very different ranges
    q, scale = quantize_weight(w, scheme)
    assert q.dtype == torch.float8_e4m3fn and tuple(scale.shape) == weight_scale_shape(scheme, n, k)
    back = dequantize_weight(q, scale, scheme)
    # e4m3 keeps 3 mantissa bits: each element within 1/16 of its group's amax.
    group_amax = {"tensor": w.abs().amax(), "channel": w.abs().amax(1, keepdim=True)}.get(scheme)
    if scheme == "block":
        group_amax = expand_blocks(scale * 448, n, k)
    assert torch.all((back - w).abs() <= group_amax / 16 + 1e-30)


def test_finer_scales_quantize_a_weight_of_uneven_rows_more_precisely():
    # Rows 1e-6 to 1 of the largest: under one scale the small ones fall to e4m3's subnormals or zero.
    w = torch.randn(256, 512) * torch.logspace(-6, 0, 256)[:, None]

    def row_error(scheme: str) -> float:
        back = dequantize_weight(*quantize_weight(w, scheme), scheme)  # type: ignore[arg-type]
        return float(((back - w).norm(dim=1) / w.norm(dim=1)).mean())

    tensor, channel, block = row_error("tensor"), row_error("channel"), row_error("block")
    assert channel < tensor / 2 and block < tensor / 2 and max(channel, block) < 0.05


def test_block_scales_cover_partial_edge_blocks():
    q, scale = quantize_weight(torch.randn(192, 576), "block")
    assert scale.shape == (2, 5)  # ceil(192/128), ceil(576/128)
    w = torch.zeros(192, 576)
    w[130, 575] = 7.0  # the only value of the last (partial) block
    _, scale = quantize_weight(w, "block")
    assert scale[1, 4] == 7.0 / 448 and scale[0, 0] == 1e-12


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_activation_scales_are_per_token_or_per_group(scheme):
    x = torch.randn(3, 300)
    x[1] *= 100
    q, scale = quantize_activation(x, scheme)
    assert scale.shape == ((3,) if scheme == "channel" else (3, 3))
    rows = scale if scheme == "channel" else scale.amax(1)
    assert rows[1] > 50 * rows[0]
    assert (dequantize_activation(q, scale, scheme) - x).abs().max() <= x.abs().amax() / 16


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_scaled_matmul_is_the_product_of_what_both_operands_stand_for(scheme):
    x, w = torch.randn(5, 300), torch.randn(200, 300)
    xq, xs = quantize_activation(x, scheme)
    wq, ws = quantize_weight(w, scheme)
    expected = dequantize_activation(xq, xs, scheme) @ dequantize_weight(wq, ws, scheme).t()
    torch.testing.assert_close(scaled_matmul(xq, xs, wq, ws, scheme), expected, rtol=1e-5, atol=1e-5)
    assert (scaled_matmul(xq, xs, wq, ws, scheme) - x @ w.t()).norm() / (x @ w.t()).norm() < 0.08


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_a_layer_of_each_scheme_runs_the_reference_math_on_a_cpu(scheme):
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 192, bias=True)
    layer = Fp8Linear.from_float(linear, scheme=scheme, name="proj")
    assert layer.scheme == scheme and layer.plan.problem.scheme == scheme
    assert {b.name for b in layer.plan.backends} == {"cpu_dequant"}
    x = torch.randn(4, 576)
    xq, xs = quantize_activation(x, scheme)
    expected = scaled_matmul(xq, xs, layer.weight, layer.weight_scale, scheme) + layer.bias
    assert torch.equal(layer(x), expected)
    assert torch.equal(layer(x), layer.plan.backend_for(4, torch.float32).run(x, layer.operands()))
    from fp8route.backends import BACKENDS

    assert torch.equal(layer(x), BACKENDS["reference"].run(x, layer.operands()))
    explained = layer.plan.explain()
    assert "dynamic per-token" in explained if scheme == "channel" else "1x128 input groups" in explained


def test_a_dynamic_scheme_takes_no_input_scale_and_checks_its_scale_shape():
    w = torch.randn(192, 576).to(torch.float8_e4m3fn)
    with pytest.raises(Fp8InputError, match="takes no input_scale"):
        Fp8Linear(w, torch.ones(192), 0.1, scheme="channel")
    with pytest.raises(Fp8InputError, match=r"expected shape \(2, 5\)"):
        Fp8Linear(w, torch.ones(2, 4), scheme="block", name="qkv")
    with pytest.raises(Fp8InputError, match=r"\(192,\) or \(192, 1\)"):
        Fp8Linear(w, torch.ones(191), scheme="channel")
    with pytest.raises(Fp8InputError, match="<= 0"):
        Fp8Linear(w, torch.zeros(192, 1), scheme="channel")
    assert Fp8Linear(w, torch.ones(192, 1), scheme="channel").weight_scale.shape == (192,)


def test_fused_shards_concatenate_their_scales_and_refuse_a_block_across_two_shards():
    ws = [torch.rand(128, 1) + 0.5, torch.rand(64, 1) + 0.5]
    w = torch.randn(192, 256).to(torch.float8_e4m3fn)
    layer = Fp8Linear.from_quantized(w, ws, None, logical_widths=[128, 64], scheme="channel")
    assert torch.equal(layer.weight_scale, torch.cat(ws).flatten())
    blocks = [torch.rand(1, 2) + 0.5, torch.rand(1, 2) + 0.5]
    fused = Fp8Linear.from_quantized(w, blocks, None, logical_widths=[128, 64], scheme="block")
    assert fused.weight_scale.shape == (2, 2) and fused.requant_error == 0.0
    with pytest.raises(Fp8InputError, match="cannot share 128x128 weight blocks"):
        Fp8Linear.from_quantized(w, blocks, None, logical_widths=[64, 128], scheme="block")
