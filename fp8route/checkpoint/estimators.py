"""Static input-scale estimators: from calibration activations to one per-tensor input scale.

Pure functions over tensors; `observer.InputObserver` collects what they need while calibration
runs. Three estimators:

- max: amax(|x|) / 448, nothing clipped (the default, and what every engine's calibrator does).
- percentile: the p-th percentile of |x| / 448: the largest (100 - p)% of values saturate at
  +-448, the rest get the finer grid of a smaller scale.
- mse: among candidate scales amax/448 * c (c in MSE_CANDIDATES), the one whose quantized layer
  output is closest to the float one, ||(q(x/s) s) @ Wq^T - x @ W^T||^2, with W quantized the way
  the checkpoint stores it (per-tensor amax/448).

e4m3 is a float format: shrinking the scale does not refine the grid of values already in the
normal range, it only moves small values out of the subnormals. Clipping outliers is what it
costs, so max is often hard to beat; the mse estimator measures rather than assumes that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fp8route.errors import Fp8InputError
from fp8route.quant import FP8_MAX, dequantize, quantize, quantize_per_tensor

ESTIMATORS = ("max", "percentile", "mse")
DEFAULT_PERCENTILE = 99.99
# The percentile's tail (the largest (100 - p)% of |x|) is kept exactly; p >= 90 bounds it to a
# tenth of one linear's calibration inputs. Lower percentiles would clip more than that anyway.
MIN_PERCENTILE = 90.0
MSE_CANDIDATES = tuple(round(1.0 - 0.1 * i, 1) for i in range(10))  # 1.0, 0.9, ..., 0.1
MIN_AMAX = 1e-6  # a linear whose input was all zeros still needs a positive scale


def check_estimator(estimator: str, percentile: float | None) -> None:
    """Raise Fp8InputError, one line, for an unknown estimator or a percentile out of range."""
    if estimator not in ESTIMATORS:
        raise Fp8InputError(f"input scale estimator must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    if percentile is not None and not (isinstance(percentile, (int, float)) and MIN_PERCENTILE <= percentile <= 100.0):
        raise Fp8InputError(
            f"percentile must be in [{MIN_PERCENTILE:g}, 100] (the share of |activations| left unclipped), "
            f"got {percentile!r}"
        )


def max_scale(amax: float) -> float:
    """amax / 448: the smallest scale that clips nothing."""
    return max(amax, MIN_AMAX) / FP8_MAX


def tail_size(count: int, percentile: float) -> int:
    """How many of the largest of `count` values decide the p-th percentile (nearest rank)."""
    # 1-based, ascending; rounded first so that 99.9% of 10000 is rank 9990, not 9991 (binary floats)
    rank = max(1, math.ceil(round(percentile * count / 100.0, 6)))
    return count - rank + 1


def percentile_value(values: torch.Tensor, percentile: float) -> float:
    """The p-th percentile of |values| by nearest rank: the smallest v with at least p% of
    |values| <= v (p = 100 is the max). Exact, not interpolated."""
    flat = values.detach().abs().flatten().float()
    if flat.numel() == 0:
        return 0.0
    k = tail_size(flat.numel(), percentile)
    return float(flat.topk(k).values.min())


def percentile_scale(tail_min: float, amax: float) -> float:
    """The percentile estimator's scale, given the percentile of |x| (never above amax / 448)."""
    return max_scale(min(tail_min, amax))


def quantized_weight(weight: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """The weight as the checkpoint stores it (e4m3, per-tensor amax/448), dequantized to fp32."""
    q, scale = quantize_per_tensor(weight.float(), name=name)
    return dequantize(q, scale)


def output_errors(
    x: torch.Tensor, weight: torch.Tensor, scales: Sequence[float], wq: torch.Tensor | None = None
) -> tuple[list[float], float]:
    """(||(q(x/s) s) @ Wq^T - x @ W^T||^2 for each scale s, ||x @ W^T||^2) over the rows of x [R, K]."""
    x = x.float()
    w = weight.float()
    wq = quantized_weight(w) if wq is None else wq
    reference = x @ w.T
    errors = []
    for s in scales:
        scale = torch.tensor(s, dtype=torch.float32)
        xq = dequantize(quantize(x, scale), scale)
        errors.append(float((xq @ wq.T - reference).square().sum()))
    return errors, float(reference.square().sum())


def mse_scale(
    x: torch.Tensor, weight: torch.Tensor, amax: float, candidates: Sequence[float] = MSE_CANDIDATES
) -> tuple[float, dict[float, float]]:
    """The candidate scale amax/448 * c with the smallest output error on x, and every
    candidate's error (keyed by c). Ties go to the larger scale (the earlier candidate)."""
    if not candidates or any(not 0.0 < c <= 1.0 for c in candidates):
        raise Fp8InputError(f"mse candidates must be fractions in (0, 1], got {list(candidates)}")
    base = max_scale(amax)
    errors, _ = output_errors(x, weight, [base * c for c in candidates])
    best = min(range(len(candidates)), key=lambda i: (errors[i], i))
    return base * candidates[best], dict(zip(candidates, errors, strict=True))


def relative_error(x: torch.Tensor, weight: torch.Tensor, scale: float) -> float:
    """||quantized output - float output||^2 / ||float output||^2 at one input scale: the
    noise-to-signal ratio the layer adds (1 / SQNR), comparable across layers of any size."""
    (error,), signal = output_errors(x, weight, [scale])
    return error / signal if signal > 0 else 0.0
