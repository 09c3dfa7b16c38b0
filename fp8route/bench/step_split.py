"""Where a decode step's GPU time goes: every kernel of a few graph-replayed steps, read through
torch.profiler (CUPTI) and summed by what it does (GEMMs, attention, the rest), per step.

A generate of 1 + STEPS tokens launches as many kernels more than a generate of 1 token on the same
prompts as its STEPS decode steps do, and launches them last: the longer call's last kernels, that many,
are the steps' (taken by count, not by subtracting the shorter call's times per kernel, whose prefill
of a long prompt varies run to run by more than a step lasts). Their sum against the measured step
time also says how long the GPU sat idle in a step (launches between graphs, host work in the way).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from fp8route.tuning.cupti import cupti_available, profiling

STEPS = 8  # decode steps profiled
TOP = 8  # the largest kernels kept by name

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


@dataclass(frozen=True)
class StepSplit:
    """One decode step's kernels: device milliseconds by kind, launches, and the largest by name."""

    ms: Mapping[str, float]  # kind -> device ms per step
    kernels: float  # launches per step
    top: tuple[tuple[str, float], ...]  # (kernel, device ms per step), largest first

    @property
    def total_ms(self) -> float:
        return sum(self.ms.values())


def kernel_times(fn: Callable[[], object]) -> list[tuple[str, float]] | None:
    """(kernel name, device ms) of every kernel one call of fn ran, in the order they started; None
    where the profiler cannot see the GPU's kernels (no CUDA, no CUPTI)."""
    if not cupti_available():
        return None
    cuda = torch.autograd.DeviceType.CUDA
    with profiling() as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.name, e.time_range.end) for e in prof.events() if e.device_type == cuda)
    return [(name, (end - start) / 1e3) for start, name, end in kernels]


def split_of(without: Sequence[tuple[str, float]], with_steps: Sequence[tuple[str, float]], steps: int) -> StepSplit:
    """Per step: the last kernels of the call with `steps` more decode steps, as many as it ran more
    than the call without."""
    extra = len(with_steps) - len(without)
    per_kernel: dict[str, float] = {}
    for name, ms in with_steps[len(with_steps) - extra :] if extra > 0 else ():
        per_kernel[name] = per_kernel.get(name, 0.0) + ms / steps
    ms_by_kind = dict.fromkeys(KINDS, 0.0)
    for name, ms in per_kernel.items():
        ms_by_kind[kind_of(name)] += ms
    top = sorted(per_kernel.items(), key=lambda item: -item[1])[:TOP]
    return StepSplit(ms_by_kind, max(extra, 0) / steps, tuple(top))


def measure(generate: Callable[[int], object]) -> StepSplit | None:
    """The split of one decode step of generate(tokens): one call for 1 token, one for 1 + STEPS."""
    without = kernel_times(lambda: generate(1))
    with_steps = kernel_times(lambda: generate(1 + STEPS))
    if without is None or with_steps is None:
        return None
    return split_of(without, with_steps, STEPS)
