"""One GEMM shape set up for timing the way a model sees it, shared by the tuner and bench.

- Weights: one random weight quantized in the layer's scheme (fp8route.schemes), cloned until the
  copies together exceed 3x the L2 and number at least eight (timing.copies_for: where a copy
  lands in memory moves kernel times by a few percent); timed call i uses copy i, so every
  call's weight comes from HBM, as in a forward pass.
- Activations: one x per M, not rotated. In a model x was just written by the previous kernel,
  so it is as hot in L2 as it can be; above a few thousand rows it does not fit anyway.
- Before an arm is timed its output is checked against the fp32 reference of the same FP8
  operands: a fast wrong kernel must not win.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from fp8route.backends import BACKENDS, DEQUANTIZED, LAYOUTS, LinearOperands
from fp8route.backends.problem import GemmProblem
from fp8route.linear.layer import Fp8Linear
from fp8route.linear.plan import Preference
from fp8route.linear.policy import Policy
from fp8route.quant import FP8_MAX, quantize
from fp8route.schemes import Scheme, quantize_weight
from fp8route.tuning import timing
from fp8route.tuning.kernel_names import kernels_by_arm


@dataclass(frozen=True)
class LayerCopy:
    """One of the rotated weight copies: the routed layer, and its operands in every layout the
    device can use (every backend is timed on every copy, whatever the layer's plan chose)."""

    layer: Fp8Linear
    operands: LinearOperands


Run = Callable[[torch.Tensor, LayerCopy], torch.Tensor]
TimeArms = Callable[..., Mapping[str, timing.ArmTiming]]

# Relative Frobenius error against the reference: bf16 output rounding is 2^-9 and K-long
# fp32 sums add little, so 1e-2 passes every correct FP8 kernel and catches wrong ones.
CHECK_TOLERANCE = 1e-2
# weight_only does not quantize x: it differs from the FP8 reference by x's e4m3 rounding (~3-4%).
TOLERANCES = {"weight_only": 6e-2}
# Unit-variance activations with headroom: a calibrated static scale under which none saturate.
INPUT_AMAX = 8.0


def routed_run(x: torch.Tensor, copy: LayerCopy) -> torch.Tensor:
    """The whole layer forward: the plan's bisect, then the backend it picked."""
    return copy.layer(x)


def backend_run(name: str) -> Run:
    """One backend on the copy's operands, x quantized by the backend."""
    backend = BACKENDS[name]
    return lambda x, copy: backend.run(x, copy.operands)


def prequantized(name: str, x_q: torch.Tensor) -> Run:
    """`name` (a backend, or routed) on x_q, x already quantized upstream: the GEMM alone. The x
    it is handed only says the output dtype; x_q must be that x quantized with the layer's scale."""
    if name == "routed":
        return lambda x, copy: copy.layer.forward_quantized(x_q, x.dtype)
    backend = BACKENDS[name]

    def run(x: torch.Tensor, copy: LayerCopy) -> torch.Tensor:
        assert copy.operands.input_scale is not None, "Workload layers have a static input scale"
        return backend.run_quantized(x_q, copy.operands.input_scale, copy.operands, x.dtype)

    return run


class Workload:
    def __init__(
        self,
        n: int,
        k: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cuda",
        preference: Preference | None = None,
        copies: int | None = None,
        seed: int = 0,
        scheme: Scheme = "tensor",
    ) -> None:
        self.n, self.k, self.dtype, self.scheme = n, k, dtype, scheme
        self.device = torch.device(device)
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        weight = torch.randn(n, k, generator=self._gen, device=self.device) * 0.02
        qweight, scale = quantize_weight(weight, scheme)
        del weight
        count = copies or timing.copies_for(qweight.numel(), self.device)
        # The tensor scheme's static input scale; the others quantize each x by its own amax.
        input_scale = torch.tensor(INPUT_AMAX / FP8_MAX, device=self.device) if scheme == "tensor" else None
        layers = [
            Fp8Linear(
                qweight if i == 0 else qweight.clone(),
                scale,
                input_scale,
                scheme=scheme,
                name=f"{n}x{k}[{i}]",
                policy=Policy(),
                preference=preference,
            )
            for i in range(count)
        ]
        # The fp32 weight copy is for cpu_dequant, which runs on CPUs only: on a GPU it would add 4x
        # every rotated weight copy for an arm that cannot be timed there.
        layouts = LAYOUTS if self.device.type == "cpu" else LAYOUTS - {DEQUANTIZED}
        self.copies = [LayerCopy(layer, layer.operands(layouts)) for layer in layers]
        self._m: int | None = None
        self._x: torch.Tensor | None = None
        self._reference: torch.Tensor | None = None

    def problem(self, m: int) -> GemmProblem:
        return self.copies[0].layer.plan.problem.with_bucket(self.dtype, m)

    def x(self, m: int) -> torch.Tensor:
        if self._m != m:
            self._x = self._reference = None
            self._x = torch.randn(m, self.k, generator=self._gen, device=self.device).to(self.dtype)
            self._m = m
        assert self._x is not None
        return self._x

    def x_quantized(self, m: int) -> torch.Tensor:
        """x(m) quantized with the layers' input scale, as a fused norm or activation would hand it over."""
        scale = self.copies[0].operands.input_scale
        assert scale is not None
        return quantize(self.x(m), scale)

    def check(self, run: Run, m: int, tolerance: float = CHECK_TOLERANCE) -> str | None:
        """None when run's output at M=m matches the reference, else what is wrong with it."""
        x = self.x(m)
        if self._reference is None:
            self._reference = BACKENDS["reference"].run(x, self.copies[0].operands).float()
        try:
            out = run(x, self.copies[0])
        except Exception as exc:  # a backend that cannot run this shape is slow, not fatal
            return _first_line(f"{type(exc).__name__}: {exc}")
        if tuple(out.shape) != (m, self.n) or out.dtype != self.dtype:
            return f"returned {out.dtype} {tuple(out.shape)}, expected {self.dtype} {(m, self.n)}"
        out = out.float()
        if not torch.isfinite(out).all():
            return "output has NaN or inf"
        ref = self._reference
        err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if err > tolerance:
            return f"output off the fp32 reference by {err:.1e} (tolerance {tolerance:.0e})"
        return None

    def kernels(self, runs: Mapping[str, Run], m: int) -> dict[str, tuple[str, ...]]:
        """The GPU kernels one call of each run launches at M=m (empty where they cannot be seen)."""
        x, copy = self.x(m), self.copies[0]
        return kernels_by_arm({name: functools.partial(run, x, copy) for name, run in runs.items()})

    def time(
        self, runs: Mapping[str, Run], m: int, *, repeats: int = 30, reps: int = 2, timer: TimeArms | None = None
    ) -> dict[str, timing.ArmTiming | str]:
        """Per arm: its timing, or why it was not timed (failed or wrong)."""
        timer = timer or timing.time_arms
        x = self.x(m)
        results: dict[str, timing.ArmTiming | str] = {}
        arms: dict[str, list[Callable[[], object]]] = {}
        for name, run in runs.items():
            reason = self.check(run, m, TOLERANCES.get(name, CHECK_TOLERANCE))
            if reason is not None:
                results[name] = reason
            else:
                arms[name] = [functools.partial(run, x, copy) for copy in self.copies]
        self._reference = None  # up to M x N fp32: not kept while timing
        if arms:
            try:
                results.update(timer(arms, repeats=repeats, reps=reps))
            except timing.HostBehindError:
                raise  # the machine, not an arm: no arm may be marked failed for it
            except Exception:
                # One arm broke while timed (out of memory at large M, say): time them one by one
                # so the others keep their numbers.
                for name, calls in arms.items():
                    try:
                        results.update(timer({name: calls}, repeats=repeats, reps=reps))
                    except timing.HostBehindError:
                        raise
                    except Exception as exc:
                        results[name] = _first_line(f"failed while timed: {type(exc).__name__}: {exc}")
        return {name: results[name] for name in runs}


class CudaMeasure:
    """The tuner's Measure on a CUDA device: one Workload per shape, kept while its M values run."""

    def __init__(
        self,
        device: torch.device | str = "cuda",
        *,
        repeats: int = 30,
        reps: int = 2,
        copies: int | None = None,
        timer: TimeArms | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.repeats, self.reps = repeats, reps
        self.copies, self.timer = copies, timer  # tests run it on CPU with a fixed count and a fake timer
        self._key: tuple[int, int, torch.dtype, str] | None = None
        self._workload: Workload | None = None

    def __call__(self, problem: GemmProblem, m: int, backends: Sequence[str]) -> dict[str, timing.ArmTiming | str]:
        key = (problem.n, problem.k, problem.out_dtype, problem.scheme)
        if key != self._key:
            self.release()
            self._workload = Workload(
                problem.n, problem.k, dtype=problem.out_dtype, device=self.device, copies=self.copies,
                scheme=problem.scheme,
            )  # fmt: skip
            self._key = key
        assert self._workload is not None
        if problem.x_quantized:
            x_q = self._workload.x_quantized(m)
            runs = {name: prequantized(name, x_q) for name in backends}
        else:
            runs = {name: backend_run(name) for name in backends}
        return self._workload.time(runs, m, repeats=self.repeats, reps=self.reps, timer=self.timer)

    def release(self) -> None:
        self._workload, self._key = None, None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= limit else line[: limit - 3] + "..."
