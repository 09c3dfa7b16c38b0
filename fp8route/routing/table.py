"""A routing table: for each tuned (N, K, dtype, input, scheme) and M bucket, the backend that measured fastest.

The input is x as the layer gets it: float (the layer quantizes it) or already quantized upstream
(Fp8Linear.forward_quantized), tuned apart because the fastest GEMM can differ once there is no
quantization pass to pay or fuse.

The table is a Preference (plan.py): the plan calls it once per (input, dtype, M bucket) when a
layer is built, so the forward pass never sees it. A shape that was not tuned takes the routes of
the nearest tuned shape, or none (the default priority); pre-quantized input with no routes of its
own takes those tuned on float input; describe() says which, and explain() shows it.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from fp8route.backends import BACKENDS
from fp8route.backends.problem import GemmProblem
from fp8route.device import DeviceInfo
from fp8route.errors import Fp8InputError
from fp8route.quant import FLOAT_DTYPE_NAMES, dtype_name
from fp8route.routing.choose import MIN_TIE, Timing, choose, priority_order
from fp8route.routing.fingerprint import Fingerprint
from fp8route.schemes import SCHEMES

log = logging.getLogger("fp8route")

FORMAT = "fp8route-routing-table"
# 2: entries may be for pre-quantized input ("x": "fp8"); version 1 files read as float input.
# 3: entries name their FP8 scheme ("scheme"); earlier files read as per-tensor.
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)

# A shape further than this from every tuned one (|log2 N ratio| + |log2 K ratio|) gets the
# default priority: past a factor of 2 the winners we measured change (DESIGN.md).
MAX_NEAREST_DISTANCE = 1.0


class RoutingTableError(Fp8InputError):
    """A routing table file is malformed; the message names the file and the field."""


ShapeKey = tuple[int, int, torch.dtype, bool, str]  # N, K, output dtype, x pre-quantized, FP8 scheme


@dataclass(frozen=True)
class ShapeRoutes:
    """One tuned shape: a route per M bucket (len(m_bounds) + 1) and what was measured per M."""

    n: int
    k: int
    dtype: torch.dtype
    routes: tuple[str | None, ...]
    timings: Mapping[str, tuple[Timing | None, ...]]  # backend -> one per measured M; None: not timed
    failures: Mapping[str, str] = field(default_factory=dict)
    x_quantized: bool = False  # tuned on x handed over quantized (the GEMM alone)
    scheme: str = "tensor"  # the FP8 scheme of the layers timed (fp8route.schemes)

    @property
    def key(self) -> ShapeKey:
        return (self.n, self.k, self.dtype, self.x_quantized, self.scheme)

    def timings_at(self, index: int) -> dict[str, Timing]:
        """Every timed backend at measured M number `index` (the last one for the open bucket)."""
        out = {}
        for name, per_m in self.timings.items():
            t = per_m[min(index, len(per_m) - 1)]
            if t is not None:
                out[name] = t
        return out


class RoutingTable:
    """Routes per (N, K, dtype, M bucket) measured on one device, stamped with its fingerprint."""

    def __init__(
        self,
        fingerprint: Fingerprint,
        m_bounds: Iterable[int],
        shapes: Iterable[ShapeRoutes],
        *,
        min_tie: float = MIN_TIE,
        created: str = "",
        command: str = "",
        origin: str = "",
    ) -> None:
        self.fingerprint = fingerprint
        self.m_bounds = tuple(m_bounds)
        if not self.m_bounds or list(self.m_bounds) != sorted(set(self.m_bounds)) or self.m_bounds[0] < 1:
            raise RoutingTableError(
                f"routing table m_bounds must be increasing positive integers, got {list(self.m_bounds)}"
            )
        self.shapes: dict[ShapeKey, ShapeRoutes] = {}
        for s in shapes:
            if len(s.routes) != len(self.m_bounds) + 1:
                raise RoutingTableError(
                    f"shape {s.n}x{s.k}: {len(s.routes)} routes for {len(self.m_bounds) + 1} M buckets"
                )
            self.shapes[s.key] = s
        self.min_tie = min_tie
        self.created = created
        self.command = command
        # Where it came from, for explain(): "routing table PATH" or "shipped defaults NAME".
        self.origin = origin or "routing table in memory"
        self._nearest: dict[ShapeKey, ShapeRoutes | None] = {}

    def __repr__(self) -> str:
        return f"<RoutingTable {len(self.shapes)} shapes on {self.fingerprint.gpu}, {self.origin}>"

    # --- lookup -------------------------------------------------------------------------------

    def applies_to(self, device: DeviceInfo) -> bool:
        if device.type != "cuda" or device.capability is None:
            return False
        major, minor = device.capability
        return device.name == self.fingerprint.gpu and f"{major}.{minor}" == self.fingerprint.capability

    def lookup(
        self, n: int, k: int, dtype: torch.dtype, x_quantized: bool = False, scheme: str = "tensor"
    ) -> tuple[ShapeRoutes, bool] | None:
        """The tuned shape itself (exact=True), else the nearest tuned one of the same scheme, else
        None. Pre-quantized input with no routes of its own near this shape takes the float-input ones."""
        found = self._lookup((n, k, dtype, x_quantized, scheme))
        if found is None and x_quantized:
            return self._lookup((n, k, dtype, False, scheme))
        return found

    def _lookup(self, key: ShapeKey) -> tuple[ShapeRoutes, bool] | None:
        exact = self.shapes.get(key)
        if exact is not None:
            return exact, True
        if key not in self._nearest:
            self._nearest[key] = self._find_nearest(*key)
        near = self._nearest[key]
        return None if near is None else (near, False)

    def _find_nearest(self, n: int, k: int, dtype: torch.dtype, x_quantized: bool, scheme: str) -> ShapeRoutes | None:
        best: tuple[tuple[float, bool, int, int], ShapeRoutes] | None = None
        for s in self.shapes.values():
            if s.dtype != dtype or s.x_quantized != x_quantized or s.scheme != scheme:
                continue
            distance = abs(math.log2(s.n / n)) + abs(math.log2(s.k / k))
            # At equal distance the same K wins: K sets the reduction (split-K, pipeline depth).
            key = (distance, s.k != k, s.n, s.k)
            if distance <= MAX_NEAREST_DISTANCE and (best is None or key < best[0]):
                best = (key, s)
        return None if best is None else best[1]

    def bucket(self, m_max: int | None) -> int:
        """Index of the table's M bucket holding m_max (None: the open bucket above the last bound)."""
        return len(self.m_bounds) if m_max is None else bisect_left(self.m_bounds, m_max)

    def __call__(self, problem: GemmProblem) -> str | None:
        """The Preference: the measured backend for this problem's bucket, or None (no measurement)."""
        if not self.applies_to(problem.device) or problem.n <= 0 or problem.k <= 0:
            return None
        found = self.lookup(problem.n, problem.k, problem.out_dtype, problem.x_quantized, problem.scheme)
        if found is None:
            return None
        shape, exact = found
        index = self.bucket(problem.m_max)
        if exact:
            # A tuned route that cannot run here becomes a fallback the plan reports, not a silent swap.
            return shape.routes[index]
        # Another shape's winner is a guess; pick among what that shape measured and this one can run.
        runnable = {
            name: t
            for name, t in shape.timings_at(index).items()
            if name in BACKENDS and BACKENDS[name].why_not(problem) is None
        }
        return choose(runnable, priority_order(problem.device), self.min_tie)

    def pick_for_every_m(
        self, problem: GemmProblem, candidates: Sequence[str]
    ) -> tuple[tuple[int | None, str], ...] | None:
        """The deterministic mode's route, (the bucket's largest M or None, candidate) per M bucket of the
        table, all of one bits family (backends that give a row the same bits as each other; a backend
        without one is a family alone). Of the candidates measured at every bucket of the tuned (or
        nearest) shape and runnable here, the family whose fastest member per bucket sums to the least
        time, each bucket's time relative to its fastest candidate (so a decode bucket weighs as much as
        a prefill one), then that member per bucket; None without such a measurement."""
        if not self.applies_to(problem.device):
            return None
        found = self.lookup(problem.n, problem.k, problem.out_dtype, problem.x_quantized, problem.scheme)
        if found is None:
            return None
        buckets = [found[0].timings_at(i) for i in range(len(self.m_bounds) + 1)]
        names = [
            name
            for name in candidates
            if name in BACKENDS
            and BACKENDS[name].why_not(problem) is None
            and all(name in t and t[name].ok for t in buckets)
        ]
        if not names:
            return None
        fastest = [min(t[name].median_us for name in names) for t in buckets]
        rank = {name: i for i, name in enumerate(priority_order(problem.device))}
        families: dict[str, list[str]] = {}
        for name in names:
            families.setdefault(BACKENDS[name].bits_family or name, []).append(name)

        def route(members: list[str]) -> tuple[str, ...]:
            return tuple(min(members, key=lambda n: (t[n].median_us, rank.get(n, len(rank)))) for t in buckets)

        routes = {family: route(members) for family, members in families.items()}

        def cost(family: str) -> tuple[float, int]:
            relative = sum(
                t[name].median_us / best if best > 0 else 1.0
                for t, best, name in zip(buckets, fastest, routes[family], strict=True)
            )
            return round(relative, 6), min(rank.get(n, len(rank)) for n in families[family])

        return tuple(zip((*self.m_bounds, None), routes[min(routes, key=cost)], strict=True))

    def describe(self, problem: GemmProblem) -> str:
        """Where a layer's routes come from, per activation dtype (the plan's source); routes for
        pre-quantized x are named apart only where the table has some of their own."""
        default = f"default priority for {problem.device.label}"
        if not self.applies_to(problem.device):
            return f"{default} ({self.origin} is for {self.fingerprint.gpu}, not this device)"
        kinds: dict[str, list[str]] = {}
        own_fp8: dict[str, list[str]] = {}
        for name, dtype in FLOAT_DTYPE_NAMES.items():
            found = self._lookup((problem.n, problem.k, dtype, False, problem.scheme))
            kinds.setdefault(self._kind(found, default), []).append(name)
            found = self._lookup((problem.n, problem.k, dtype, True, problem.scheme))
            if found is not None:
                own_fp8.setdefault(self._kind(found, default), []).append(name)
        if len(kinds) == 1:
            text = next(iter(kinds))
        else:
            text = "; ".join(f"{', '.join(names)}: {kind}" for kind, names in kinds.items())
        if own_fp8:
            text += "; x pre-quantized " + "; ".join(f"{', '.join(names)}: {kind}" for kind, names in own_fp8.items())
        return f"{text}; {self.origin}"

    @staticmethod
    def _kind(found: tuple[ShapeRoutes, bool] | None, default: str) -> str:
        if found is None:
            return default
        shape, exact = found
        return "tuned" if exact else f"nearest tuned shape {shape.n}x{shape.k}"

    # --- building and (de)serialising ---------------------------------------------------------

    def merged_with(self, newer: RoutingTable) -> RoutingTable:
        """This table's shapes plus newer's, newer winning on the same (N, K, dtype, input)."""
        if newer.m_bounds != self.m_bounds:
            log.warning(
                "dropping %d shapes of %s: they were tuned at M %s, the new ones at M %s",
                len(self.shapes),
                self.origin,
                list(self.m_bounds),
                list(newer.m_bounds),
            )
            return newer
        commands = dict.fromkeys(c for c in (*self.command.split("; "), newer.command) if c)
        return RoutingTable(
            newer.fingerprint,
            newer.m_bounds,
            [*(s for key, s in self.shapes.items() if key not in newer.shapes), *newer.shapes.values()],
            min_tie=newer.min_tie,
            created=newer.created,
            command="; ".join(commands),
            origin=newer.origin,
        )

    def to_json(self) -> dict[str, object]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "fingerprint": self.fingerprint.to_json(),
            "created": self.created,
            "command": self.command,
            "min_tie": self.min_tie,
            "m_bounds": list(self.m_bounds),
            "shapes": [
                _shape_to_json(s)
                for s in sorted(self.shapes.values(), key=lambda s: (s.scheme, s.x_quantized, str(s.dtype), s.n, s.k))
            ],
        }

    @classmethod
    def from_json(cls, obj: object, origin: str = "") -> RoutingTable:
        """Parse and validate; every problem is a RoutingTableError naming the field."""
        where = origin or "routing table"
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise RoutingTableError(f'{where}: not an fp8route routing table (no "format": "{FORMAT}")')
        if obj.get("version") not in READABLE_VERSIONS:
            readable = ", ".join(map(str, READABLE_VERSIONS))
            raise RoutingTableError(f"{where}: format version {obj.get('version')!r}, this fp8route reads {readable}")
        try:
            fingerprint = Fingerprint.from_json(obj["fingerprint"])
            m_bounds = [_int(v, "m_bounds") for v in _list(obj["m_bounds"], "m_bounds")]
            shapes = [_shape_from_json(s, len(m_bounds)) for s in _list(obj["shapes"], "shapes")]
            min_tie = float(obj.get("min_tie", MIN_TIE))
        except (KeyError, TypeError, ValueError) as exc:
            raise RoutingTableError(f"{where}: {exc}") from None
        return cls(
            fingerprint,
            m_bounds,
            shapes,
            min_tie=min_tie,
            created=str(obj.get("created", "")),
            command=str(obj.get("command", "")),
            origin=origin,
        )

    def with_origin(self, origin: str) -> RoutingTable:
        return RoutingTable(
            self.fingerprint,
            self.m_bounds,
            self.shapes.values(),
            min_tie=self.min_tie,
            created=self.created,
            command=self.command,
            origin=origin,
        )


def _shape_to_json(s: ShapeRoutes) -> dict[str, object]:
    return {
        "n": s.n,
        "k": s.k,
        "dtype": dtype_name(s.dtype),
        "x": "fp8" if s.x_quantized else "float",
        "scheme": s.scheme,
        "routes": list(s.routes),
        # Failed runs are null: JSON has no infinity.
        "median_us": {
            b: [None if t is None or not t.ok else round(t.median_us, 3) for t in ts] for b, ts in s.timings.items()
        },
        "spread": {
            b: [None if t is None or not t.ok else round(t.spread, 4) for t in ts] for b, ts in s.timings.items()
        },
        "failed": dict(s.failures),
    }


def _shape_from_json(obj: object, n_bounds: int) -> ShapeRoutes:
    if not isinstance(obj, dict):
        raise ValueError(f"each entry of shapes must be an object, got {obj!r}")
    n, k = _int(obj["n"], "n"), _int(obj["k"], "k")
    if n <= 0 or k <= 0:
        raise ValueError(f"shape {n}x{k}: N and K must be positive")
    dtype_name = obj["dtype"]
    if dtype_name not in FLOAT_DTYPE_NAMES:
        raise ValueError(f"shape {n}x{k}: unknown dtype {dtype_name!r}; known: {', '.join(FLOAT_DTYPE_NAMES)}")
    x_kind = obj.get("x", "float")
    if x_kind not in ("float", "fp8"):
        raise ValueError(f'shape {n}x{k}: x must be "float" or "fp8", got {x_kind!r}')
    scheme = obj.get("scheme", "tensor")
    if scheme not in SCHEMES:
        raise ValueError(f"shape {n}x{k}: unknown scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    routes = tuple(_route(r, n, k) for r in _list(obj["routes"], "routes"))
    medians, spreads = obj.get("median_us", {}), obj.get("spread", {})
    if not isinstance(medians, dict) or not isinstance(spreads, dict):
        raise ValueError(f"shape {n}x{k}: median_us and spread must be objects")
    failures = obj.get("failed", {})
    if not isinstance(failures, dict):
        raise ValueError(f"shape {n}x{k}: failed must be an object")
    timings: dict[str, tuple[Timing | None, ...]] = {}
    for name, values in medians.items():
        values = _list(values, f"median_us.{name}")
        spread = _list(spreads.get(name, [0.0] * len(values)), f"spread.{name}")
        if len(values) != n_bounds or len(spread) != n_bounds:
            raise ValueError(f"shape {n}x{k}: {name} has {len(values)} times for {n_bounds} M values")
        # null: not timed there, or failed ("failed" says why); either way never chosen.
        timings[str(name)] = tuple(
            None if v is None else Timing(float(v), float(sp or 0.0)) for v, sp in zip(values, spread)
        )
    failed = {str(a): str(b) for a, b in failures.items()}
    dtype = FLOAT_DTYPE_NAMES[dtype_name]
    return ShapeRoutes(n, k, dtype, routes, timings, failed, x_quantized=x_kind == "fp8", scheme=scheme)


def _route(value: object, n: int, k: int) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"shape {n}x{k}: routes must be backend names or null, got {value!r}")


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be integers, got {value!r}")
    return value


def _list(value: object, what: str) -> list:  # type: ignore[type-arg]
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list, got {type(value).__name__}")
    return value
