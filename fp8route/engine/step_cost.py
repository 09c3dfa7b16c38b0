"""StepCost: how long a step takes for the sequences and tokens it computes, fitted once at start
from timed steps, so that the scheduler can size each step's prefill chunks to keep an inter-token
latency target (EngineConfig.itl_target_ms), as Sarathi-Serve's stall-free batching does against a
TBT SLO. A step's attention over long contexts is not in the model yet: it prices a decode row at
what a short one costs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepCost:
    fixed_ms: float  # what any step's forward costs however small
    per_row_ms: float  # each sequence it computes
    per_token_ms: float  # each token it computes

    def ms(self, rows: int, tokens: int) -> float:
        return self.fixed_ms + self.per_row_ms * rows + self.per_token_ms * tokens

    def tokens_within(self, target_ms: float, rows: int) -> int:
        """The most tokens a step of this many sequences computes within target_ms (0 if none fit)."""
        room = target_ms - self.fixed_ms - self.per_row_ms * rows
        return max(0, int(room / self.per_token_ms)) if self.per_token_ms > 0 else 1 << 30

    def __str__(self) -> str:
        return f"{self.fixed_ms:.2f} ms + {self.per_row_ms:.4f} ms a sequence + {self.per_token_ms:.5f} ms a token"


def fit(samples: Sequence[tuple[int, int, float]]) -> StepCost:
    """The least-squares StepCost of timed steps (sequences, tokens, ms), no coefficient below zero."""
    rows = np.array([[1.0, r, t] for r, t, _ in samples])
    ms = np.array([m for _, _, m in samples])
    coefficients = np.linalg.lstsq(rows, ms, rcond=None)[0]
    fixed, per_row, per_token = (max(0.0, float(c)) for c in coefficients)
    return StepCost(fixed, per_row, per_token)
