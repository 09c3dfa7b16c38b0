import pytest
import torch

from fp8route import Fp8InputError, Fp8TypeError, dequantize, quantize_per_tensor, requantize_shards
from fp8route.quant import FP8_DTYPE, FP8_MAX, as_scale, quantize


def test_quantize_scales_to_amax_and_round_trips():
    x = torch.randn(64, 128) * 3
    q, scale = quantize_per_tensor(x)
    assert q.dtype == FP8_DTYPE
    assert scale.item() == pytest.approx(x.abs().max().item() / FP8_MAX)
    assert q.float().abs().max().item() == FP8_MAX
    # e4m3 keeps 3 mantissa bits: relative rounding error at most 2^-4 for normal values.
    back = dequantize(q, scale)
    normal = x.abs() > scale * 2**-6
    assert ((back - x).abs()[normal] / x.abs()[normal]).max() <= 2**-4 + 1e-6


def test_quantize_saturates_instead_of_producing_nan():
    q = quantize(torch.tensor([1e6, -1e6, 1.0]), torch.tensor(1.0))
    assert q.float().tolist() == [FP8_MAX, -FP8_MAX, 1.0]


def test_requantize_shards_to_max_scale_and_reports_error():
    torch.manual_seed(0)
    shards = [torch.randn(32, 64) * s for s in (0.1, 1.0, 0.01)]
    qs, scales = zip(*(quantize_per_tensor(s) for s in shards))
    fused = requantize_shards(torch.cat(qs), list(scales), [32, 32, 32])
    assert fused.scale == max(scales)
    original = torch.cat([dequantize(q, s) for q, s in zip(qs, scales)])
    diff = dequantize(fused.weight, fused.scale) - original
    assert diff.abs().max().item() == pytest.approx(fused.max_abs_error)
    assert 0 < fused.rel_error < 0.1
    # The shard that already had the max scale is untouched.
    assert torch.equal(fused.weight[32:64].view(torch.uint8), qs[1].view(torch.uint8))


def test_requantize_shards_rejects_widths_that_do_not_cover_n():
    q, s = quantize_per_tensor(torch.randn(10, 16))
    with pytest.raises(Fp8InputError, match="sum to 9, weight has N=10"):
        requantize_shards(q, [s, s], [4, 5])


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (torch.tensor(float("nan")), Fp8InputError, "finite and > 0"),
        (torch.tensor(float("inf")), Fp8InputError, "finite and > 0"),
        (torch.tensor(0.0), Fp8InputError, "finite and > 0"),
        (torch.tensor(-1.0), Fp8InputError, "finite and > 0"),
        (torch.ones(2), Fp8InputError, r"shape \[\] or \[1\]"),
        (torch.tensor(1), Fp8TypeError, "float32/bfloat16/float16"),
        ("0.5", Fp8TypeError, "got str"),
    ],
)
def test_bad_scales_are_named(value, error, match):
    with pytest.raises(error, match=match) as info:
        as_scale("layers.0.weight_scale", value)
    assert "layers.0.weight_scale" in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scales_of_shape_one_and_low_precision_become_fp32_scalars(dtype):
    scale = as_scale("s", torch.tensor([0.25], dtype=dtype))
    assert scale.shape == () and scale.dtype == torch.float32 and scale.item() == 0.25
