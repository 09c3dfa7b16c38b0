"""StepCost: how long a step takes for the sequences and tokens it computes and the cached positions
its rows read, so that the scheduler can size each step's prefill chunks to keep an inter-token
latency target (EngineConfig.itl_target_ms), as Sarathi-Serve's stall-free batching does against a
TBT SLO. The sequences and tokens are priced by a fit to steps timed at start over short contexts;
each cached position by its K/V bytes over the copy bandwidth measured at start, since reading a
long context is what a decode row's attention spends its time on."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fp8route.tuning.timing import copy_bandwidth_gbs


@dataclass(frozen=True)
class StepCost:
    fixed_ms: float  # what any step's forward costs however small
    per_row_ms: float  # each sequence it computes
    per_token_ms: float  # each token it computes
    per_position_ms: float = 0.0  # each cached position its sequences read

    def ms(self, rows: int, tokens: int, positions: int = 0) -> float:
        return self.fixed_ms + self.per_row_ms * rows + self.per_token_ms * tokens + self.per_position_ms * positions

    def tokens_within(self, target_ms: float, rows: int, positions: int = 0) -> int:
        """The most tokens a step of this many sequences, reading this many cached positions, computes
        within target_ms (0 if none fit)."""
        room = target_ms - self.fixed_ms - self.per_row_ms * rows - self.per_position_ms * positions
        return max(0, int(room / self.per_token_ms)) if self.per_token_ms > 0 else 1 << 30

    def __str__(self) -> str:
        return (
            f"{self.fixed_ms:.2f} ms + {self.per_row_ms:.4f} ms a sequence + {self.per_token_ms:.5f} ms a token"
            f" + {1e3 * self.per_position_ms:.4f} us a cached position"
        )


def fit(samples: Sequence[tuple[int, int, float]]) -> StepCost:
    """The least-squares StepCost of timed steps (sequences, tokens, ms), no coefficient below zero."""
    rows = np.array([[1.0, r, t] for r, t, _ in samples])
    ms = np.array([m for _, _, m in samples])
    coefficients = np.linalg.lstsq(rows, ms, rcond=None)[0]
    fixed, per_row, per_token = (max(0.0, float(c)) for c in coefficients)
    return StepCost(fixed, per_row, per_token)


def copy_gbs(device: torch.device, nbytes: int = 256 << 20) -> float:
    """The device's copy bandwidth in GB/s (bytes read and written), the median of five copies of
    nbytes (past any L2): what a cached position's K/V read is priced at."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            gbs = copy_bandwidth_gbs(nbytes, repeats=5)
            torch.cuda.empty_cache()  # the copies' memory back to the GPU, where the pool's sizing counts it free
        return gbs
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times) / 1e9
