"""What calibration keeps of each linear's inputs, in bounded memory, and the scale it picks.

Per linear: the running amax; for the percentile estimator, the exact tail of |x| (the largest
(100 - p)% of values, merged batch by batch with topk, so the percentile is exact and memory is
at most a tenth of the linear's inputs, p >= 90); and a uniform random subsample of input rows
(SAMPLE_ROWS, reservoir-style: each row gets a random key and the smallest keys are kept), on
which the mse estimator searches and every linear's output error is measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fp8route.checkpoint import estimators
from fp8route.models.llama import FloatLinear

SAMPLE_ROWS = 1024


@dataclass(frozen=True)
class ScaleChoice:
    """One linear's input scale and what calibration measured about it."""

    scale: float
    amax: float
    rel_error: float  # ||Δy||² / ||y||² at this scale, with the weight quantized, on the row subsample
    clip_fraction: float  # c in scale = amax/448 * c (1.0: nothing clipped)


class InputObserver:
    """Collects one linear's calibration inputs (forward pre-hook) for one estimator."""

    def __init__(
        self, estimator: str, percentile: float | None, total_rows: int, sample_rows: int = SAMPLE_ROWS, seed: int = 0
    ) -> None:
        estimators.check_estimator(estimator, percentile)
        self.estimator = estimator
        self.percentile = estimators.DEFAULT_PERCENTILE if percentile is None else float(percentile)
        self.total_rows, self.sample_rows = total_rows, sample_rows
        self.amax = 0.0
        self.rows_seen = 0
        self.tail: torch.Tensor | None = None
        self.keep = 0  # tail length, set from the input width on the first batch
        self.sample = torch.empty(0)
        self.keys = torch.empty(0)
        self.generator = torch.Generator().manual_seed(seed)

    def update(self, x: torch.Tensor) -> None:
        rows = x.detach().reshape(-1, x.shape[-1]).float()
        self.rows_seen += rows.shape[0]
        self.amax = max(self.amax, float(rows.abs().max())) if rows.numel() else self.amax
        if self.estimator == "percentile":
            if self.tail is None:
                count = max(self.total_rows, self.rows_seen) * rows.shape[1]
                self.keep = estimators.tail_size(count, self.percentile)
                self.tail = rows.new_empty(0)
            merged = torch.cat([self.tail, rows.abs().flatten()])
            self.tail = merged.topk(min(self.keep, merged.numel())).values
        keys = torch.rand(rows.shape[0], generator=self.generator).to(rows.device)
        if self.sample.numel() == 0:
            self.sample, self.keys = rows.new_empty(0, rows.shape[1]), keys.new_empty(0)
        keys = torch.cat([self.keys, keys])
        kept = keys.topk(min(self.sample_rows, keys.numel()), largest=False).indices
        self.sample, self.keys = torch.cat([self.sample, rows])[kept], keys[kept]

    def choose(self, weight: torch.Tensor, name: str = "weight") -> ScaleChoice:
        """The input scale for this linear's weight [N, K] (name: what an error calls it), and its output error."""
        if self.rows_seen == 0:
            return ScaleChoice(estimators.max_scale(0.0), 0.0, 0.0, 1.0)
        base = estimators.max_scale(self.amax)
        wq = estimators.quantized_weight(weight, name)
        if self.estimator == "max":
            scale = base
        elif self.estimator == "percentile":
            assert self.tail is not None
            scale = estimators.percentile_scale(float(self.tail.min()), self.amax)
        else:
            scale, _ = estimators.mse_scale(self.sample, weight, self.amax)
        (error,), signal = estimators.output_errors(self.sample, weight, [scale], wq)
        return ScaleChoice(scale, self.amax, error / signal if signal > 0 else 0.0, scale / base)


def observe(
    layer: nn.Module, prefix: str, make: Callable[[], InputObserver], wanted: Callable[[str], bool]
) -> dict[str, InputObserver]:
    """An observer on each FloatLinear of `layer` whose full name `wanted` accepts, fed by forward
    pre-hooks as calibration runs (the hooks stay for the layer's lifetime, which ends with its
    calibration)."""
    observers: dict[str, InputObserver] = {}
    for name, module in layer.named_modules():
        full = f"{prefix}.{name}" if name else prefix
        if isinstance(module, FloatLinear) and wanted(full):
            observers[full] = make()
            module.register_forward_pre_hook(lambda _, args, o=observers[full]: o.update(args[0]))
    return observers
