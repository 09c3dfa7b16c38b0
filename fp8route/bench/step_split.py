"""A decode step of a batch, isolated: its wall time and, read through torch.profiler (CUPTI), where its
GPU time goes: every kernel of a few graph-replayed steps summed by what it does (GEMMs, attention,
the rest), per step.

The prompts run as requests of the engine until every one of them is prefilled; then TIMED engine
steps are timed in a row and STEPS more profiled: decode steps of every row only. (Comparing a
generate of more tokens with one of fewer does not isolate them: with a batch of long prompts the
first rows decode while the last are still prefilling, and decode alone once the first are done, so
the difference holds mixed steps and steps of fewer rows.) The kernels' sum against the timed step
also says how long the GPU sat idle in a step (launches between graphs, host work in the way).
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from fp8route.engine.llm_engine import LLMEngine
from fp8route.engine.sampling import SamplingParams
from fp8route.tuning.cupti import cupti_available, profiling

TIMED = 16  # decode steps timed in a row, unprofiled
STEPS = 8  # decode steps profiled after them
TOP = 8  # the largest kernels kept by name
# An idle stretch between kernels up to this long is a kernel boundary's (the next one's blocks placed
# and started: ~0.5 us on an H100); a longer one waited for something else (the host, a copy).
BUBBLE_US = 5.0

# fp8route's paged attention (_attention_kernel, _merge_kernel) and decode kernels (_split_kernel,
# _combine_kernel); FlashInfer's, FlashAttention's and cuDNN's by their own words. Read first: a
# library's attention kernel may name a GEMM it runs inside.
_ATTENTION = re.compile(
    r"attention|^_merge_kernel$|^_split_kernel$|^_combine_kernel$|flash_fwd|flash_attn|fmha|sdpa"
    r"|BatchDecode|BatchPrefill|SingleDecode|SinglePrefill",
    re.IGNORECASE,
)
# cuBLASLt's Hopper kernels are "nvjet_*", its older ones "*gemm*"/"*gemv*"; CUTLASS's "cutlass*"/"*xmma*";
# fp8route's Triton GEMMs: the decode GEMM's two kernels, block_gemm_kernel, fixed_gemm_kernel.
_GEMM = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|matmul|decode_mma_kernel|decode_cuda_core_kernel", re.IGNORECASE)
KINDS = ("gemm", "attention", "rest")


def kind_of(kernel: str) -> str:
    """ "gemm", "attention" or "rest" (norms, RoPE, quantization, SiLU, sampling, copies) for a kernel name."""
    if _ATTENTION.search(kernel):
        return "attention"
    if _GEMM.search(kernel):
        return "gemm"
    return "rest"


class Kernel(NamedTuple):
    """One kernel the profiler saw: its name, when it started and how long it ran (device ms)."""

    name: str
    start_ms: float
    ms: float


@dataclass(frozen=True)
class StepSplit:
    """One decode step's kernels: device milliseconds by kind, launches, the largest by name, and the
    GPU's idle time between them (device ms per step): at kernel boundaries (bubbles, each up to
    BUBBLE_US) and longer (stalls)."""

    ms: Mapping[str, float]  # kind -> device ms per step
    launches: Mapping[str, float]  # kind -> launches per step
    top: tuple[tuple[str, float], ...]  # (kernel, device ms per step), largest first
    bubble_ms: float = 0.0
    stall_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        return sum(self.ms.values())

    @property
    def kernels(self) -> float:
        """Launches per step, of every kind."""
        return sum(self.launches.values())


def kernel_times(fn: Callable[[], object]) -> list[Kernel] | None:
    """Every kernel one call of fn ran, in the order they started; None where the profiler cannot see
    the GPU's kernels (no CUDA, no CUPTI)."""
    if not cupti_available():
        return None
    cuda = torch.autograd.DeviceType.CUDA
    with profiling() as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted((e.time_range.start, e.name, e.time_range.end) for e in prof.events() if e.device_type == cuda)
    return [Kernel(name, start / 1e3, (end - start) / 1e3) for start, name, end in events]


def split_of(kernels: Sequence[Kernel], steps: int) -> StepSplit:
    """Per step: the kernels of `steps` steps (in the order they started), summed by name and by kind,
    and the idle stretches between them. A kernel counts from when the kernels before it had all
    ended: with programmatic dependent launch one starts while the one before it runs and waits for
    it, and that wait is the earlier kernel's time (counted twice, the kinds summed past 100%)."""
    per_kernel: dict[str, float] = {}
    launches = dict.fromkeys(KINDS, 0.0)
    bubbles = stalls = 0.0
    end = kernels[0].start_ms if kernels else 0.0  # the latest any kernel so far ran to
    for k in kernels:
        idle = k.start_ms - end
        if idle > BUBBLE_US / 1e3:
            stalls += idle
        elif idle > 0:
            bubbles += idle
        own = max(0.0, k.start_ms + k.ms - max(k.start_ms, end))
        per_kernel[k.name] = per_kernel.get(k.name, 0.0) + own / steps
        launches[kind_of(k.name)] += 1 / steps
        end = max(end, k.start_ms + k.ms)
    ms_by_kind = dict.fromkeys(KINDS, 0.0)
    for name, ms in per_kernel.items():
        ms_by_kind[kind_of(name)] += ms
    top = sorted(per_kernel.items(), key=lambda item: -item[1])[:TOP]
    return StepSplit(ms_by_kind, launches, tuple(top), bubbles / steps, stalls / steps)


@dataclass(frozen=True)
class DecodeSteps:
    """A batch's decode steps, every prompt prefilled: the wall time of one (the median of TIMED in a
    row) and its spread ((max - min) / median), the positions its rows attend to (the KV it reads, on
    average over those steps), and its kernels (None where the profiler cannot see them)."""

    wall_ms: float
    spread: float
    positions: float
    split: StepSplit | None


def measure(engine: LLMEngine, prompts: Sequence[Sequence[int]]) -> DecodeSteps | None:
    """The decode steps of these prompts run together on an idle engine; None where the engine's
    context left a prompt too few tokens to decode through the timed and profiled steps."""
    # Each up to the engine's context, not a default max_tokens: the first prompts of a batch that takes many
    # steps to prefill decode while the last prefill, and must still be running for the measured steps.
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=None)
    requests = [engine.add_request(ids, params, request_id=f"step-split-{i}") for i, ids in enumerate(prompts)]
    try:
        while engine.has_unfinished and any(r.num_output_tokens == 0 for r in requests):
            engine.step()
        # Every prompt has a token read back, so every step from the one in flight on is decode only;
        # the one in flight finishes before the measured ones start.
        _synchronize(engine)
        positions = sum(r.length for r in requests) + len(requests) * TIMED / 2
        walls = _step_walls_ms(engine)
        kernels = kernel_times(lambda: [engine.step() for _ in range(STEPS)])
        whole = not any(r.finished for r in requests)
    finally:
        for r in requests:
            engine.abort(r.request_id)
        engine.drain()
    if not whole:
        return None
    wall = statistics.median(walls)
    split = split_of(kernels, STEPS) if kernels is not None else None
    return DecodeSteps(wall, (max(walls) - min(walls)) / wall, positions, split)


def _step_walls_ms(engine: LLMEngine) -> list[float]:
    """The times between TIMED engine steps' returns: each returns once the step before it is read
    back (with async scheduling; else its own), so in a row each is a step's time. The first is left
    out: the step it read had finished before it was called."""
    returns = []
    for _ in range(TIMED):
        engine.step()
        returns.append(time.perf_counter())
    return [1e3 * (b - a) for a, b in zip(returns, returns[1:])]


def _synchronize(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
