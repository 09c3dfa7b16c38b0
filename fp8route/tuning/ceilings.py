"""The two ceilings a GEMM's floor is measured against, both measured in the run that uses them."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch

from fp8route.tuning import timing

PEAK_SIZE = 8192  # M = N = K: large enough that the FP8 tensor cores, not memory, set the time


@dataclass(frozen=True)
class Ceilings:
    copy_gbs: float  # device copy bandwidth, bytes read + written per second / 1e9
    fp8_tflops: float  # dense FP8 GEMM throughput, the best of cuBLASLt with and without fast accum

    def floor_us(self, flops: float, nbytes: float) -> float:
        """The least time a GEMM can take: its bytes at copy bandwidth or its FLOPs at peak."""
        return max(nbytes / (self.copy_gbs * 1e9), flops / (self.fp8_tflops * 1e12)) * 1e6

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def measure_ceilings(device: torch.device | str = "cuda", clock: str = "events") -> Ceilings:
    """Both ceilings, timed by the clock the arms are timed by (timing.CLOCKS): a floor from one
    clock against times from the other would be off by the launch edges the events include."""
    with torch.cuda.device(torch.device(device)):
        return Ceilings(copy_gbs=timing.copy_bandwidth_gbs(clock=clock), fp8_tflops=fp8_peak_tflops(clock=clock))


def fp8_peak_tflops(size: int = PEAK_SIZE, repeats: int = 20, clock: str = "events") -> float:
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(size, size, generator=gen, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(size, size, generator=gen, device="cuda").to(torch.float8_e4m3fn)  # [N, K]
    one = torch.ones((), device="cuda")
    best = 0.0
    for fast in (False, True):

        def call(fast: bool = fast) -> torch.Tensor:
            return torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast)

        times = timing.time_cold([call], repeats=repeats, warmup=3, clock=clock)
        best = max(best, 2 * size**3 / (statistics.median(times) * 1e-6) / 1e12)
    return best
