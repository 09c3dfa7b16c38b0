"""The tuner: time every eligible backend per (shape, M) and turn the timings into a RoutingTable.

Timing itself is injected (a Measure), so this logic runs on CPU in tests with a fake; the CUDA
measurement lives in fp8route/tuning/workload.py.
"""

from __future__ import annotations

import datetime
import functools
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from fp8route.backends import BACKENDS, last_resorts
from fp8route.backends.problem import GemmProblem
from fp8route.device import DeviceInfo
from fp8route.errors import Fp8InputError
from fp8route.linear.plan import M_BOUNDS
from fp8route.models.shapes import LayerShape
from fp8route.progress import Progress
from fp8route.quant import dtype_name
from fp8route.routing.choose import MIN_TIE, Timing, choose, priority_order
from fp8route.routing.fingerprint import Fingerprint
from fp8route.routing.table import RoutingTable, ShapeRoutes
from fp8route.schemes import Scheme, check_scheme
from fp8route.tuning.timing import steadiest

log = logging.getLogger("fp8route")

# Times `backends` for problem (N, K, out dtype, device) at M rows. Per backend: a timing (any
# object with median_us and spread), or the reason it could not be trusted (an exception, a
# wrong result), which counts as infinitely slow.
Measure = Callable[[GemmProblem, int, Sequence[str]], Mapping[str, object]]

_NOT_TIMED = -1.0


class Tuner:
    def __init__(
        self,
        measure: Measure,
        device: DeviceInfo,
        fingerprint: Fingerprint,
        *,
        m_values: Sequence[int] = M_BOUNDS,
        dtypes: Sequence[torch.dtype] = (torch.bfloat16,),
        backends: Sequence[str] | None = None,
        min_tie: float = MIN_TIE,
        progress: Progress | None = None,
        command: str = "",
        x_quantized: bool = False,
        scheme: Scheme = "tensor",
    ) -> None:
        unknown = [name for name in backends or () if name not in BACKENDS]
        if unknown:
            raise Fp8InputError(f"unknown backends {unknown}; known: {', '.join(BACKENDS)}")
        if not m_values or list(m_values) != sorted(set(m_values)) or m_values[0] < 1:
            raise Fp8InputError(f"M values must be increasing positive integers, got {list(m_values)}")
        self.measure = measure
        self.device = device
        self.fingerprint = fingerprint
        self.m_values = tuple(m_values)
        self.dtypes = tuple(dtypes)
        self.backends = tuple(backends) if backends else None
        self.min_tie = min_tie
        self.progress = progress
        self.command = command
        self.x_quantized = x_quantized  # time the GEMMs on x handed over quantized (forward_quantized)
        if x_quantized and scheme != "tensor":
            raise Fp8InputError(f"x handed over quantized needs a static input scale: the {scheme} scheme has none")
        self.scheme = check_scheme(scheme)

    def candidates(self, problem: GemmProblem) -> list[str]:
        """Backends worth timing here: those that can run it, less the last resorts (which only
        run where nothing better can), unless named explicitly."""
        names = self.backends or tuple(name for name in BACKENDS if name not in last_resorts(self.device))
        return [name for name in names if BACKENDS[name].why_not(problem) is None]

    def tune(self, shapes: Iterable[LayerShape | tuple[int, int]]) -> RoutingTable:
        keys = list(dict.fromkeys((s.n, s.k) if isinstance(s, LayerShape) else (int(s[0]), int(s[1])) for s in shapes))
        cells = [(n, k, dtype) for n, k in keys for dtype in self.dtypes]
        names = list(BACKENDS)  # a fixed axis, so every rank's array lines up for the all-reduce
        times = torch.full((len(cells), len(self.m_values), len(names), 2), _NOT_TIMED, dtype=torch.float64)
        failures: dict[int, dict[str, list[str]]] = {}
        total, done = len(cells) * len(self.m_values), 0
        for ci, (n, k, dtype) in enumerate(cells):
            base = GemmProblem(
                n, k, self.device, out_dtype=dtype, static_input_scale=self.scheme == "tensor",
                scheme=self.scheme, x_quantized=self.x_quantized,
            )  # fmt: skip
            for mi, m in enumerate(self.m_values):
                if self.progress:
                    self.progress(done, total, f"{n}x{k} {dtype_name(dtype)} M={m}")
                problem = base.with_bucket(dtype, m)
                wanted = self.candidates(problem)
                results = steadiest(functools.partial(self.measure, problem, m, wanted)) if wanted else {}
                results = self._head_to_head(problem, m, results)
                for name in wanted:
                    timing, reason = _as_timing(results.get(name, "the measurement returned nothing for it"))
                    times[ci, mi, names.index(name)] = torch.tensor(
                        [timing.median_us, timing.spread], dtype=torch.float64
                    )
                    if reason is not None:
                        failures.setdefault(ci, {}).setdefault(name, []).append(f"M={m}: {reason}")
                done += 1
        if self.progress:
            self.progress(done, total, "done")
        times = agree_across_ranks(times)
        shaped = [self._routes(cell, times[ci], names, failures.get(ci, {})) for ci, cell in enumerate(cells)]
        return RoutingTable(
            self.fingerprint,
            self.m_values,
            shaped,
            min_tie=self.min_tie,
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command=self.command,
        )

    def _head_to_head(self, problem: GemmProblem, m: int, results: Mapping[str, object]) -> Mapping[str, object]:
        """When a tie hands the bucket to a backend other than the fastest, time those two again,
        by themselves: head to head, the two arms' spread is tighter than in a many-arm batch, and
        a real gap stops being a tie (benchmarks/TIMING.md)."""
        timings = {name: t for name, result in results.items() if (t := _as_timing(result)[0]).ok}
        winner = choose(timings, priority_order(self.device), self.min_tie)
        fastest = min(timings, key=lambda name: timings[name].median_us, default=None)
        if winner is None or fastest is None or winner == fastest:
            return results
        if _gap(timings[winner], timings[fastest]) <= self.min_tie:
            return results  # within min_tie it stays a tie however tight the spreads: nothing to settle
        again = steadiest(functools.partial(self.measure, problem, m, [winner, fastest]))
        if not all(_as_timing(again.get(name, "missing"))[0].ok for name in (winner, fastest)):
            return results  # a backend that ran a moment ago failed now: keep the first verdict
        return {**results, winner: again[winner], fastest: again[fastest]}

    def _routes(
        self, cell: tuple[int, int, torch.dtype], times: torch.Tensor, names: list[str], failed: dict[str, list[str]]
    ) -> ShapeRoutes:
        n, k, dtype = cell
        priority = priority_order(self.device)
        timings: dict[str, list[Timing | None]] = {}
        for bi, name in enumerate(names):
            per_m = [None if t[0] == _NOT_TIMED else Timing(float(t[0]), float(t[1])) for t in times[:, bi].tolist()]
            if any(t is not None for t in per_m):
                timings[name] = per_m
        routes: list[str | None] = []
        for mi, m in enumerate(self.m_values):
            here = {name: t for name, per_m in timings.items() if (t := per_m[mi]) is not None}
            winner = choose(here, priority, self.min_tie)
            if winner is None and here:
                log.warning(
                    "every backend failed on %dx%d M=%d; that bucket keeps the default priority: %s",
                    n,
                    k,
                    m,
                    _reasons(failed, m),
                )
            routes.append(winner)
        routes.append(routes[-1])  # M above the last measured value: the largest M's winner
        return ShapeRoutes(
            n,
            k,
            dtype,
            tuple(routes),
            {name: tuple(per_m) for name, per_m in timings.items()},
            {b: "; ".join(r) for b, r in failed.items()},
            x_quantized=self.x_quantized,
            scheme=self.scheme,
        )


def agree_across_ranks(times: torch.Tensor) -> torch.Tensor:
    """With torch.distributed up, every rank gets the slowest rank's time per cell, so all ranks
    route alike: a tensor-parallel step waits for its slowest rank, and a backend that failed on
    any rank (inf) is failed everywhere."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return times
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    # Check the sizes first: an all-reduce of unequal tensors hangs or corrupts, a size check cannot.
    size = torch.tensor([times.numel(), -times.numel()], dtype=torch.float64, device=device)
    dist.all_reduce(size, op=dist.ReduceOp.MAX)
    if size[0].item() != -size[1].item():
        raise Fp8InputError(
            f"rank {dist.get_rank()} tuned {times.numel()} timings but another rank more: run the same "
            "`fp8route tune` arguments (model, tp, M values, dtypes) on every rank"
        )
    reduced = times.to(device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return reduced.cpu()


def _gap(slower: Timing, faster: Timing) -> float:
    return (slower.median_us - faster.median_us) / slower.median_us if slower.median_us > 0 else 0.0


def _as_timing(result: object) -> tuple[Timing, str | None]:
    if isinstance(result, str):
        return Timing(math.inf, 0.0), result
    median, spread = getattr(result, "median_us", None), getattr(result, "spread", None)
    if not isinstance(median, (int, float)) or not isinstance(spread, (int, float)) or math.isnan(median) or median < 0:
        return Timing(math.inf, 0.0), f"unusable timing {result!r}"
    return Timing(float(median), float(spread)), None


def _reasons(failed: dict[str, list[str]], m: int) -> str:
    here = {name: [r for r in reasons if r.startswith(f"M={m}:")] for name, reasons in failed.items()}
    return "; ".join(f"{name}: {' / '.join(r)}" for name, r in here.items() if r) or "no reasons recorded"
