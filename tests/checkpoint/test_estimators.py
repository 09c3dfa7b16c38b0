"""Input-scale estimators on synthetic activations: max, percentile and mse, and the observer
that feeds them in bounded memory."""

import pytest
import torch

from fp8route.checkpoint import estimators
from fp8route.checkpoint.observer import InputObserver
from fp8route.errors import Fp8InputError
from fp8route.quant import FP8_MAX


def outlier_case(scale: float = 1e5, read: float = 1e-6, seed: int = 0):
    """Gaussian inputs [4096, 64] with one outlier of size `scale` in channel 0, and a weight
    whose column 0 is `read` times the others (how much the layer's output feels channel 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, 64, generator=g)
    x[17, 0] = scale
    w = torch.randn(32, 64, generator=g)
    w[:, 0] *= read
    return x, w


def test_heavy_tail_percentile_and_mse_beat_max():
    # amax/448 = 223 puts the whole Gaussian bulk in e4m3's subnormals (below 2^-6 * 223 = 3.5),
    # rounded to steps of 2^-9 * 223 = 0.44. The outlier's channel barely reaches the output, so
    # clipping it costs far less than the bulk's rounding saves.
    x, w = outlier_case()
    base = estimators.max_scale(float(x.abs().max()))
    p_scale = estimators.percentile_scale(estimators.percentile_value(x, 99.99), float(x.abs().max()))
    m_scale, errors = estimators.mse_scale(x, w, float(x.abs().max()))
    assert p_scale < base / 100 and m_scale < base
    e_max = estimators.relative_error(x, w, base)
    e_pct = estimators.relative_error(x, w, p_scale)
    e_mse = estimators.relative_error(x, w, m_scale)
    assert e_pct < e_max / 10 and e_mse < e_max / 10
    assert errors[1.0] == max(errors.values()) and min(errors, key=errors.get) < 1.0


def test_an_outlier_the_weight_reads_is_not_clipped_by_mse():
    # The same outlier read at full weight: clipping it costs more than all the bulk's rounding,
    # so the least-error scale is amax/448 (e4m3 is a float grid; smaller scales buy little).
    x, w = outlier_case(scale=200.0, read=1.0)
    scale, errors = estimators.mse_scale(x, w, float(x.abs().max()))
    assert scale == estimators.max_scale(200.0) and min(errors, key=errors.get) == 1.0


def test_percentile_is_exact_nearest_rank():
    values = torch.arange(1, 10001, dtype=torch.float32)[torch.randperm(10000)]
    assert estimators.percentile_value(values, 99.9) == 9990.0
    assert estimators.percentile_value(-values, 99.99) == 9999.0
    assert estimators.percentile_value(values, 100.0) == 10000.0
    assert estimators.percentile_value(values, 90.0) == 9000.0
    assert estimators.tail_size(10000, 99.9) == 11


def test_observer_percentile_over_batches_equals_the_exact_one():
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(1, n, 48, generator=g) * (1 + i) for i, n in enumerate((100, 37, 256, 9))]
    total = sum(b.shape[1] for b in batches)
    observer = InputObserver("percentile", 99.5, total_rows=total, sample_rows=64)
    for b in batches:
        observer.update(b)
    everything = torch.cat([b.reshape(-1, 48) for b in batches])
    assert observer.amax == float(everything.abs().max())
    assert observer.tail is not None and observer.tail.numel() == estimators.tail_size(everything.numel(), 99.5)
    assert float(observer.tail.min()) == estimators.percentile_value(everything, 99.5)
    # The row subsample is bounded and made of real rows.
    assert observer.sample.shape == (64, 48)
    assert all((everything == row).all(dim=1).any() for row in observer.sample)
    choice = observer.choose(torch.randn(16, 48, generator=g))
    assert choice.scale == estimators.percentile_value(everything, 99.5) / FP8_MAX and 0 < choice.clip_fraction < 1


def test_mse_picks_the_known_optimum():
    # Channel 0 holds 448 and is unread (zero weight column); the others hold 0.84375 = 0.75 * 1.125.
    # At scale 0.75 every value the weight reads is exact in e4m3; at 1.0 and 0.5 it falls halfway
    # between two e4m3 values. The weight (entries 0, +-1, 0.5) quantizes exactly.
    x = torch.full((8, 16), 0.84375)
    x[:, 0] = 448.0
    w = torch.tensor([[0.0] + [1.0, -1.0, 0.5] * 5, [0.0] + [0.5, 1.0, -1.0] * 5])
    scale, errors = estimators.mse_scale(x, w, 448.0, candidates=(1.0, 0.75, 0.5))
    assert scale == 0.75 and errors[0.75] == 0.0 and errors[1.0] > 0 and errors[0.5] > 0


@pytest.mark.parametrize(
    "estimator, percentile, message",
    [
        ("entropy", None, "estimator must be one of max, percentile, mse, got 'entropy'"),
        ("percentile", 100.5, "percentile must be in [90, 100]"),
        ("percentile", 50.0, "percentile must be in [90, 100]"),
    ],
)
def test_bad_estimator_settings(estimator, percentile, message):
    with pytest.raises(Fp8InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        estimators.check_estimator(estimator, percentile)
