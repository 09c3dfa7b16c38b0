"""The two ceilings a GEMM's floor is measured against, both measured in the run that uses them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from fp8route.bench import timing

PEAK_SIZE = 8192  # M = N = K: large enough that the FP8 tensor cores, not memory, set the time
# Seconds of back-to-back peak GEMMs before the sustained rate is timed: on the H200 they reach the
# power cap and the clocks settle well within this (results/h200/routing/interleaved/smi.csv).
SETTLE_S = 1.0


@dataclass(frozen=True)
class Ceilings:
    copy_gbs: float  # device copy bandwidth, bytes read + written per second / 1e9
    fp8_tflops: float  # dense FP8 GEMM throughput, the best of cuBLASLt with and without fast accum
    # The same GEMMs kept running for a second: the rate the GPU sustains once its power cap has
    # lowered the clocks (prefill-sized GEMMs run in that state). None where not measured.
    fp8_tflops_sustained: float | None = None

    def floor_us(self, flops: float, nbytes: float, *, sustained: bool = False) -> float:
        """The least time a GEMM can take: its bytes at copy bandwidth or its FLOPs at peak
        (the burst peak, or the sustained one)."""
        peak = self.fp8_tflops_sustained if sustained and self.fp8_tflops_sustained else self.fp8_tflops
        return max(nbytes / (self.copy_gbs * 1e9), flops / (peak * 1e12)) * 1e6

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def measure_ceilings(device: torch.device | str = "cuda") -> Ceilings:
    with torch.cuda.device(torch.device(device)):
        return Ceilings(
            copy_gbs=timing.copy_bandwidth_gbs(),
            fp8_tflops=fp8_peak_tflops(),
            fp8_tflops_sustained=fp8_peak_tflops(settle_s=SETTLE_S),
        )


def fp8_peak_tflops(size: int = PEAK_SIZE, repeats: int = 20, settle_s: float = 0.0) -> float:
    """Best of cuBLASLt with and without fast accumulation: 20 calls (~15 ms) give the burst rate;
    after settle_s of the same calls, the rate under the power cap."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(size, size, generator=gen, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(size, size, generator=gen, device="cuda").to(torch.float8_e4m3fn)  # [N, K]
    one = torch.ones((), device="cuda")
    best = 0.0
    for fast in (False, True):

        def call(fast: bool = fast) -> torch.Tensor:
            return torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast)

        _run_for(call, settle_s)
        times = timing.time_cold([call], repeats=repeats, warmup=3)
        best = max(best, 2 * size**3 / (statistics.median(times) * 1e-6) / 1e12)
    return best


def _run_for(call: Callable[[], object], seconds: float) -> None:
    """Keep the GPU on call() for about `seconds`, in short rounds: the launch queue holds only a
    few hundred calls (a batch of 700 queued behind one sleep never got ahead of it)."""
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        for _ in range(32):
            call()
        torch.cuda.synchronize()
