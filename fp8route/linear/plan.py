"""A layer's plan: which backend runs each M bucket, decided once, with every reason kept.

The plan also names the operand layouts its backends read, and the layer prepares exactly those
at load time, so the layout and the kernel that runs can never disagree; explain shows what
memory they cost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from fp8route.backends import BACKENDS, Backend, default_priority, deterministic_default, last_resorts
from fp8route.backends.base import LAYOUT_TEXT, layout_bytes
from fp8route.backends.problem import GemmProblem
from fp8route.errors import BackendUnavailableError, StrictModeError
from fp8route.linear.policy import Policy
from fp8route.quant import FLOAT_DTYPES, dtype_name
from fp8route.schemes import DESCRIPTION

log = logging.getLogger("fp8route")

# Bucket i holds M in (M_BOUNDS[i-1], M_BOUNDS[i]]; one more bucket holds M > 16384.
M_BOUNDS: tuple[int, ...] = tuple(2**i for i in range(15))

# A routing table answers "which backend is fastest here", or None where it has no measurement.
# One that also has describe(problem) -> str names where its answers come from (tuned, nearest
# tuned shape, default priority): that becomes the plan's source, which explain() shows.
Preference = Callable[[GemmProblem], str | None]

# A cache of the fallbacks already logged in this process: each is logged once, not once per layer.
_logged: set[str] = set()


@dataclass(frozen=True)
class Fallback:
    dtype: torch.dtype
    m_lo: int
    m_hi: int | None
    wanted: str
    used: str
    reason: str
    x_quantized: bool = False  # on the route for x handed over quantized (forward_quantized)


def fallback_lines(fallbacks: Sequence[Fallback]) -> list[str]:
    """One line per distinct fallback, with the activation dtypes it applies to."""
    dtypes: dict[tuple[int, int | None, str, str, str], list[str]] = {}
    for f in fallbacks:
        name = ("x pre-quantized " if f.x_quantized else "") + dtype_name(f.dtype)
        dtypes.setdefault((f.m_lo, f.m_hi, f.wanted, f.used, f.reason), []).append(name)
    return [f"{', '.join(d)} {_m_range(lo, hi)}: {w} -> {u} ({r})" for (lo, hi, w, u, r), d in dtypes.items()]


@dataclass(frozen=True)
class Exclusion:
    backend: str
    reason: str
    dtypes: tuple[torch.dtype, ...]  # the activation dtypes the reason holds for

    def __str__(self) -> str:
        scope = "" if self.dtypes == FLOAT_DTYPES else ", ".join(map(dtype_name, self.dtypes)) + ": "
        return scope + self.reason


@dataclass(frozen=True, eq=False)
class Plan:
    layer: str
    problem: GemmProblem
    bounds: tuple[int, ...]
    routes: dict[torch.dtype, tuple[Backend, ...]]  # x in that dtype: the layer quantizes it
    excluded: tuple[Exclusion, ...]
    fallbacks: tuple[Fallback, ...]
    source: str
    # x handed over already quantized, the output in that dtype (Fp8Linear.forward_quantized)
    quantized_routes: dict[torch.dtype, tuple[Backend, ...]]

    def backend_for(self, m: int, dtype: torch.dtype, x_quantized: bool = False) -> Backend:
        routes = self.quantized_routes if x_quantized else self.routes
        return routes[dtype][bucket_index(self.bounds, m)]

    @property
    def backends(self) -> frozenset[Backend]:
        every = (*self.routes.values(), *self.quantized_routes.values())
        return frozenset(b for route in every for b in route)

    @property
    def layouts(self) -> frozenset[str]:
        return frozenset(layout for b in self.backends for layout in b.layouts)

    @property
    def prepared_bytes(self) -> dict[str, int]:
        """The memory each layout the layer prepares for this plan adds beyond the checkpoint's
        tensors, where it adds any."""
        p = self.problem
        sizes = {layout: layout_bytes(layout, p.n, p.k, p.scheme) for layout in sorted(self.layouts)}
        return {layout: size for layout, size in sizes.items() if size}

    def prepared_text(self) -> str:
        """What the layer holds for this plan beyond the checkpoint's tensors, and its size."""
        if not self.prepared_bytes:
            return "nothing beyond the checkpoint's tensors"
        weight = size_text(self.problem.n * self.problem.k)
        parts = []
        for layout, size in self.prepared_bytes.items():
            readers = ", ".join(sorted(b.name for b in self.backends if layout in b.layouts))
            parts.append(f"{LAYOUT_TEXT[layout]} {size_text(size)} (for {readers}; the e4m3 weight is {weight})")
        return "; ".join(parts)

    @property
    def _all_routes(self) -> tuple[tuple[Backend, ...], ...]:
        return (*self.routes.values(), *self.quantized_routes.values())

    @property
    def _switches(self) -> bool:
        """Whether some input's route changes with M to a backend that may give a row other bits."""
        return any(len({b.bits_family or b.name for b in route}) > 1 for route in self._all_routes)

    @property
    def batch_invariant(self) -> bool:
        """Whether each row's result is the same bits whatever M is: each input's route keeps to one
        backend, or to one bits family, for every M, and no backend's rows depend on M."""
        return not self._switches and all(b.batch_variance(self.problem) is None for b in self.backends)

    def invariance_text(self) -> str:
        """batch_invariant as explain says it: yes, or no and why."""
        if self.batch_invariant:
            families = {
                b.bits_family for route in self._all_routes if len(set(route)) > 1 for b in route if b.bits_family
            }
            return "yes" + "".join(f" (the tiling changes with M within one family: {f})" for f in sorted(families))
        varying = {b.name: b.batch_variance(self.problem) for b in self.backends}
        reasons = [f"{name}: {why}" for name, why in sorted(varying.items()) if why is not None]
        return "no (" + "; ".join(reasons + (["the backend changes with M"] if self._switches else [])) + ")"

    def route_text(self, dtype: torch.dtype, x_quantized: bool = False) -> str:
        route = (self.quantized_routes if x_quantized else self.routes)[dtype]
        return "; ".join(f"{m_range} -> {name}" for m_range, name in _runs(self.bounds, route))

    def explain(self, layer: str | None = None) -> str:
        """What runs for each input dtype and M range, what was excluded and why, every fallback;
        headed by `layer` (default: this plan's layer)."""
        p = self.problem
        device = p.device.label + (f" ({p.device.name})" if p.device.name and p.device.type == "cuda" else "")
        scales = f"{'static' if p.static_input_scale else 'dynamic'} input scale" if p.scheme == "tensor" else ""
        lines = [
            f"{layer or self.layer}  N={p.n} K={p.k}  {device}, {DESCRIPTION[p.scheme]}"
            f"{', ' + scales if scales else ''}, {'bias' if p.has_bias else 'no bias'}",
            f"  routes ({self.source}):",
        ]
        by_text: dict[str, list[str]] = {}
        for dtype in self.routes:
            by_text.setdefault(self.route_text(dtype), []).append(dtype_name(dtype))
        lines += [f"    {', '.join(dtypes)}: {text}" for text, dtypes in by_text.items()]
        if not p.static_input_scale:
            lines.append("    x pre-quantized (forward_quantized): none (the scales come from each x)")
        elif self.quantized_routes == self.routes:
            lines.append("    x pre-quantized (forward_quantized): the same")
        else:
            by_text = {}
            for dtype in self.quantized_routes:
                by_text.setdefault(self.route_text(dtype, True), []).append(dtype_name(dtype))
            lines += [f"    x pre-quantized -> {', '.join(dtypes)}: {text}" for text, dtypes in by_text.items()]
        lines.append(f"  batch-invariant (a row's bits whatever its batch): {self.invariance_text()}")
        lines.append(f"  made at plan time, per layer: {self.prepared_text()}")
        if self.excluded:
            width = max(len(e.backend) for e in self.excluded)
            lines.append("  excluded:")
            lines += [f"    {e.backend:<{width}}  {e}" for e in self.excluded]
        lines.append("  fallbacks:" + ("" if self.fallbacks else " none"))
        lines += [f"    {line}" for line in fallback_lines(self.fallbacks)]
        return "\n".join(lines)


def size_text(nbytes: int) -> str:
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.1f} KiB" if nbytes >= 2**10 else f"{nbytes} B"


def make_plan(
    layer: str,
    problem: GemmProblem,
    policy: Policy | None = None,
    preference: Preference | None = None,
    source: str | None = None,
) -> Plan:
    """Choose a backend for every (activation dtype, M bucket) of one layer.

    The forced backend, else the routing table's choice, else the first runnable backend in
    the device's default priority. A fallback is recorded (logged once, or raised under strict
    mode) when a forced or tuned choice cannot run, or when only a last resort can.
    """
    policy = policy or Policy()
    # The device's order among the backends that compute the layer's scheme: what a fallback names as wanted.
    priority = [
        name
        for name in default_priority(problem.device)
        if name not in policy.disable and problem.scheme in BACKENDS[name].schemes
    ]
    resorts = last_resorts(problem.device)
    reasons: dict[tuple[str, str], dict[torch.dtype, None]] = {
        (name, "disabled by FP8ROUTE_DISABLE"): dict.fromkeys(FLOAT_DTYPES) for name in sorted(policy.disable)
    }
    routes: dict[bool, dict[torch.dtype, tuple[Backend, ...]]] = {False: {}, True: {}}
    fallbacks: list[Fallback] = []
    # The deterministic mode's route per activation dtype, one bits family for every M; x handed over
    # quantized takes the same: the same e4m3 x, the same bits, whichever way it came.
    every_m = {dtype: _pick_for_every_m(problem.with_bucket(dtype, None), policy, preference) for dtype in FLOAT_DTYPES}
    # x handed over quantized needs a static input scale: the dynamic schemes have no such route.
    for x_quantized in (False, True) if problem.static_input_scale else (False,):
        for dtype in FLOAT_DTYPES:
            route: list[Backend] = []
            for lo, hi in _bucket_ranges(M_BOUNDS):
                bucket = problem.with_bucket(dtype, hi).with_input(x_quantized)
                why = {n: _why_not(BACKENDS[n], bucket, policy) for n in BACKENDS if n not in policy.disable}
                for name, reason in why.items():
                    if reason is not None:
                        reasons.setdefault((name, reason), {})[dtype] = None
                # The deterministic mode: its route from the table's timings (its per-M picks are for speed
                # alone), else the device's default for the mode.
                if policy.deterministic:
                    measured = every_m[dtype]
                    preferred = _at(measured, hi) if measured else deterministic_default(problem.device, hi)
                else:
                    preferred = preference(bucket) if preference else None
                used, wanted = _pick(why, policy.force or (preferred if preferred in why else None), priority)
                if wanted is not None and used != wanted and (policy.force or preferred or used in resorts):
                    fallback = Fallback(dtype, lo, hi, wanted, used, why[wanted] or "", x_quantized)
                    # The same fallback on both inputs is one fallback: reported once.
                    if not (x_quantized and replace(fallback, x_quantized=False) in fallbacks):
                        fallbacks.append(fallback)
                route.append(BACKENDS[used])
            routes[x_quantized][dtype] = tuple(route)
    order = list(BACKENDS)
    ranked = sorted(reasons.items(), key=lambda item: order.index(item[0][0]))
    excluded = tuple(Exclusion(name, reason, tuple(dtypes)) for (name, reason), dtypes in ranked)
    merged = tuple(_merge(fallbacks))
    source = source if source is not None else _source(problem, policy, preference, any(every_m.values()))
    plan = Plan(layer, problem, M_BOUNDS, routes[False], excluded, merged, source, routes[True] or routes[False])
    _check_forced(plan, policy)
    if policy.deterministic:
        _check_invariant(plan)
    _report(plan, policy)
    return plan


RouteByM = tuple[tuple[int | None, str], ...]  # (a bucket's largest M, None: no limit; its backend), by M


def _pick_for_every_m(problem: GemmProblem, policy: Policy, preference: Preference | None) -> RouteByM | None:
    """The deterministic mode's measured route for one input, a backend per M bucket, all of one bits
    family: what a routing table's timings favour over all its buckets (RoutingTable.pick_for_every_m), or None."""
    pick = getattr(preference, "pick_for_every_m", None) if policy.deterministic else None
    if pick is None:
        return None
    invariant = [n for n, b in BACKENDS.items() if n not in policy.disable and b.batch_variance(problem) is None]
    chosen = pick(problem, invariant)
    return tuple(chosen) if chosen else None


def _at(route: RouteByM, m: int | None) -> str:
    """route's backend for M up to m (None: beyond every bound)."""
    return next(name for bound, name in route if bound is None or (m is not None and m <= bound))


def _why_not(backend: Backend, bucket: GemmProblem, policy: Policy) -> str | None:
    """Why backend cannot run bucket under policy: its own reason, or in deterministic mode why a
    row's result could change with the batch."""
    reason = backend.why_not(bucket)
    if reason is None and policy.deterministic:
        variance = backend.batch_variance(bucket)
        reason = None if variance is None else f"deterministic mode: a row's result can change with M, {variance}"
    return reason


def _check_invariant(plan: Plan) -> None:
    """Deterministic mode: batch-invariant backends of one bits family for every M of each input, or a
    clear refusal (a route that changed family with M would change a row's bits with its batch)."""
    if plan.batch_invariant:
        return
    p = plan.problem
    reasons = "; ".join(f"{e.backend}: {e.reason}" for e in plan.excluded)
    raise BackendUnavailableError(
        f"layer {plan.layer} (N={p.n}, K={p.k}, {DESCRIPTION[p.scheme]}) on {p.device.label}: deterministic "
        f"mode needs batch-invariant backends of one family for every M, and none runs it here ({reasons}). "
        "Run without deterministic mode, or on a CPU."
    )


def _source(problem: GemmProblem, policy: Policy, preference: Preference | None, measured_every_m: bool) -> str:
    """Where a plan's choices come from, as Plan.source says it."""
    describe = getattr(preference, "describe", None)
    default = f"default priority for {problem.device.label}"
    if policy.force:
        return f"forced by FP8ROUTE_FORCE={policy.force}"
    if policy.deterministic and callable(describe):
        if measured_every_m:
            return (
                "deterministic mode: the batch-invariant backends timed fastest over every M, one family, "
                f"{describe(problem)}"
            )
        return (
            "deterministic mode: the table timed no batch-invariant backend at every M here, so the mode's "
            f"default for {problem.device.label}"
        )
    if policy.deterministic:
        return f"deterministic mode: the mode's default for {problem.device.label}"
    if callable(describe):
        return str(describe(problem))
    return default


def _pick(why: dict[str, str | None], wanted: str | None, priority: list[str]) -> tuple[str, str | None]:
    """(the backend a bucket runs, the one it was meant to run) given why each backend cannot run it
    (None: it can): wanted (forced or tuned) when it can run, else the first runnable backend of
    priority, standing in for wanted or, with none wanted, for the first of priority that cannot run."""
    if wanted is not None and why[wanted] is None:
        return wanted, wanted
    used = next((name for name in priority if why[name] is None), "reference")
    return used, wanted or next((name for name in priority if why[name] is not None), None)


def _check_forced(plan: Plan, policy: Policy) -> None:
    if policy.force and all(b.name != policy.force for b in plan.backends):
        reasons = "; ".join(sorted({f.reason for f in plan.fallbacks}))
        raise BackendUnavailableError(
            f"layer {plan.layer} (N={plan.problem.n}, K={plan.problem.k}): FP8ROUTE_FORCE={policy.force} "
            f"cannot run it: {reasons}. Force a backend that explain() lists as runnable (FP8ROUTE_FORCE, or "
            "eval's --backends), or none."
        )


def _report(plan: Plan, policy: Policy) -> None:
    if not plan.fallbacks:
        return
    summary = "; ".join(fallback_lines(plan.fallbacks))
    if policy.strict:
        raise StrictModeError(
            f"layer {plan.layer} (N={plan.problem.n}, K={plan.problem.k}) would fall back: {summary}. "
            "strict mode (strict=True or FP8ROUTE_STRICT=1) forbids fallbacks."
        )
    key = f"N={plan.problem.n} K={plan.problem.k}: {summary}"
    if key not in _logged:
        _logged.add(key)
        log.warning("fallback on %s (first seen on layer %s; explain() lists every layer)", key, plan.layer)


def bucket_index(bounds: Sequence[int], m: int) -> int:
    """bisect_left, written out because torch.compile cannot trace the C bisect module."""
    lo, hi = 0, len(bounds)
    while lo < hi:
        mid = (lo + hi) // 2
        if bounds[mid] < m:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _bucket_ranges(bounds: Sequence[int]) -> list[tuple[int, int | None]]:
    lows = [1, *(b + 1 for b in bounds)]
    return list(zip(lows, [*bounds, None]))


def _m_range(lo: int, hi: int | None) -> str:
    if hi is None:
        return f"M {lo}+"
    return f"M {lo}" if lo == hi else f"M {lo}-{hi}"


def _runs(bounds: Sequence[int], route: Sequence[Backend]) -> list[tuple[str, str]]:
    """Adjacent buckets with the same backend, merged into one M range."""
    runs: list[tuple[int, int | None, str]] = []
    for (lo, hi), backend in zip(_bucket_ranges(bounds), route):
        if runs and runs[-1][2] == backend.name:
            runs[-1] = (runs[-1][0], hi, backend.name)
        else:
            runs.append((lo, hi, backend.name))
    return [(_m_range(lo, hi), name) for lo, hi, name in runs]


def _merge(fallbacks: list[Fallback]) -> list[Fallback]:
    """Adjacent buckets that fell back the same way, as one M range."""
    merged: list[Fallback] = []
    for f in fallbacks:
        last = merged[-1] if merged else None
        if (
            last
            and last.m_hi is not None
            and last.m_hi + 1 == f.m_lo
            and (last.dtype, last.x_quantized, last.wanted, last.used, last.reason)
            == (f.dtype, f.x_quantized, f.wanted, f.used, f.reason)
        ):
            merged[-1] = replace(last, m_hi=f.m_hi)
        else:
            merged.append(f)
    return merged
