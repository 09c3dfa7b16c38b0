"""What `fp8route bench gemm` measured, turned into long-form rows, layer sums, verdicts and text.

Pure arithmetic on timings (no GPU), so the figures a result file claims are tested in CI.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fp8route.models.shapes import LayerShape
from fp8route.routing.choose import MIN_TIE, Timing, ties
from fp8route.tuning.ceilings import Ceilings

ROUTED = "routed"
SUM = "layer sum"
# Per-tensor cuBLASLt against rowwise CUTLASS: the two kernels a per-tensor FP8 layer is usually run with.
CUBLAS, ROWWISE = "cublas", "rowwise"
PREFILL_M = 2048
FLOOR_TARGET = 1.05


@dataclass(frozen=True)
class Cell:
    shape: LayerShape
    m: int
    arm: str  # "routed" or a backend name
    median_us: float | None  # None: not timed (failed, wrong, or not eligible); error says why
    spread: float = 0.0
    rep_medians_us: tuple[float, ...] = ()
    error: str | None = None
    backend: str | None = None  # routed: the backend its plan ran at this M
    kernels: tuple[str, ...] = ()  # the GPU kernels one call launched (profiler), when seen

    @property
    def timing(self) -> Timing | None:
        return None if self.median_us is None else Timing(self.median_us, self.spread)


def gemm_flops(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


def gemm_bytes(m: int, n: int, k: int, act_bytes: int = 2) -> float:
    """What the layer must move at least: the e4m3 weight, x in and y out in the activation dtype."""
    return n * k + m * k * act_bytes + m * n * act_bytes


class GemmReport:
    def __init__(
        self,
        cells: Sequence[Cell],
        shapes: Sequence[LayerShape],
        m_values: Sequence[int],
        ceilings: Ceilings,
        *,
        act_bytes: int = 2,
        min_tie: float = MIN_TIE,
    ) -> None:
        self.shapes, self.m_values, self.ceilings = list(shapes), list(m_values), ceilings
        self.act_bytes, self.min_tie = act_bytes, min_tie
        self.cells = {(c.shape.label, c.m, c.arm): c for c in cells}
        arms = list(dict.fromkeys(c.arm for c in cells))
        self.arms = [ROUTED] * (ROUTED in arms) + [a for a in arms if a != ROUTED]
        self.policies = [a for a in self.arms if a != ROUTED]

    @property
    def targets(self) -> list[LayerShape | str]:
        """Every shape, then the layer sum."""
        return [*self.shapes, SUM]

    def timed_policies(self) -> list[str]:
        """The policies timed at least once (a backend absent on this machine has cells, none timed)."""
        return [p for p in self.policies if any(c.arm == p and c.median_us is not None for c in self.cells.values())]

    def cell(self, shape: LayerShape, m: int, arm: str) -> Cell | None:
        return self.cells.get((shape.label, m, arm))

    def floor_us(self, shape: LayerShape, m: int) -> float:
        return self.ceilings.floor_us(gemm_flops(m, shape.n, shape.k), gemm_bytes(m, shape.n, shape.k, self.act_bytes))

    def timing(self, target: LayerShape | str, m: int, arm: str) -> Timing | None:
        """One shape's timing, or for SUM the sum over every shape (None unless all were timed);
        the sum's spread is the largest of its parts'."""
        if isinstance(target, LayerShape):
            c = self.cell(target, m, arm)
            return None if c is None else c.timing
        parts = [t for s in self.shapes if (t := self.timing(s, m, arm)) is not None]
        if len(parts) < len(self.shapes):
            return None
        return Timing(sum(p.median_us for p in parts), max(p.spread for p in parts))

    def floor(self, target: LayerShape | str, m: int) -> float:
        if isinstance(target, LayerShape):
            return self.floor_us(target, m)
        return sum(self.floor_us(s, m) for s in self.shapes)

    def speedup(self, target: LayerShape | str, m: int, policy: str) -> float | None:
        routed, other = self.timing(target, m, ROUTED), self.timing(target, m, policy)
        if routed is None or other is None or routed.median_us <= 0:
            return None
        return other.median_us / routed.median_us

    def twin(self, target: LayerShape | str, m: int) -> Timing | None:
        """The routed backend's own single-policy arm (for SUM, the sum of those): the same kernels
        as routed, timed once more."""
        if isinstance(target, LayerShape):
            c = self.cell(target, m, ROUTED)
            return None if c is None or c.backend is None else self.timing(target, m, c.backend)
        parts = [t for s in self.shapes if (t := self.twin(s, m)) is not None]
        if len(parts) < len(self.shapes):
            return None
        return Timing(sum(p.median_us for p in parts), max(p.spread for p in parts))

    def twin_gap(self, target: LayerShape | str, m: int) -> float:
        """|routed - twin| / the larger: how far two timings of the very same kernels fell apart
        in this run, i.e. the noise between arms (which the rep-to-rep spread of one arm understates)."""
        routed, twin = self.timing(target, m, ROUTED), self.twin(target, m)
        if routed is None or twin is None:
            return 0.0
        return abs(routed.median_us - twin.median_us) / max(routed.median_us, twin.median_us, 1e-30)

    def violations(self) -> list[str]:
        """Every (shape or layer sum, M, policy) where routed is slower beyond the measured spread:
        the larger of the two arms' rep spreads, min_tie, and the twin gap."""
        out = []
        for target in self.targets:
            for m in self.m_values:
                routed = self.timing(target, m, ROUTED)
                if routed is None:
                    continue
                gap = self.twin_gap(target, m)
                for policy in self.policies:
                    other = self.timing(target, m, policy)
                    if other is None:
                        continue
                    if routed.median_us > other.median_us and not ties(routed, other, max(self.min_tie, gap)):
                        name = target.label if isinstance(target, LayerShape) else SUM
                        out.append(
                            f"{name} M={m}: routed {routed.median_us:.1f} us vs {policy} {other.median_us:.1f} us "
                            f"(spreads {routed.spread:.1%}, {other.spread:.1%}; twin gap {gap:.1%})"
                        )
        return out

    def twin_gaps(self) -> list[float]:
        """Signed (routed - twin) / twin per shape and M: a routed path with overhead of its own
        would show as gaps leaning one way."""
        out = []
        for s in self.shapes:
            for m in self.m_values:
                routed, twin = self.timing(s, m, ROUTED), self.twin(s, m)
                if routed is not None and twin is not None and twin.median_us > 0:
                    out.append(routed.median_us / twin.median_us - 1)
        return out

    def untimed_routed(self) -> list[str]:
        return [
            f"{s.label} M={m}: {c.error if c else 'not run'}"
            for s in self.shapes
            for m in self.m_values
            if (c := self.cell(s, m, ROUTED)) is None or c.median_us is None
        ]

    def prefill_floor_ratios(self) -> dict[int, float]:
        """Routed layer sum / floor for M >= 2048 (the target is <= 1.05)."""
        out = {}
        for m in self.m_values:
            t = self.timing(SUM, m, ROUTED)
            if m >= PREFILL_M and t is not None:
                out[m] = t.median_us / self.floor(SUM, m)
        return out

    def rows(self) -> list[dict[str, Any]]:
        """Long form: one row per (shape or layer sum, M, arm)."""
        rows = []
        for target in self.targets:
            for m in self.m_values:
                for arm in self.arms:
                    rows.append(self._row(target, m, arm))
        return rows

    def _row(self, target: LayerShape | str, m: int, arm: str) -> dict[str, Any]:
        is_shape = isinstance(target, LayerShape)
        n, k = (target.n, target.k) if isinstance(target, LayerShape) else (None, None)
        t = self.timing(target, m, arm)
        floor = self.floor(target, m)
        flops = gemm_flops(m, n, k) if n and k else sum(gemm_flops(m, s.n, s.k) for s in self.shapes)
        nbytes = (
            gemm_bytes(m, n, k, self.act_bytes)
            if n and k
            else sum(gemm_bytes(m, s.n, s.k, self.act_bytes) for s in self.shapes)
        )
        c = self.cell(target, m, arm) if isinstance(target, LayerShape) else None
        row: dict[str, Any] = {
            "shape": target.label if isinstance(target, LayerShape) else SUM,
            "n": n,
            "k": k,
            "m": m,
            "arm": arm,
            "median_us": None if t is None else round(t.median_us, 3),
            "spread": None if t is None else round(t.spread, 4),
            "floor_us": round(floor, 3),
        }
        if t is not None and t.median_us > 0:
            seconds = t.median_us * 1e-6
            row.update(
                tflops=round(flops / seconds / 1e12, 2),
                gbs=round(nbytes / seconds / 1e9, 1),
                pct_of_floor=round(100 * floor / t.median_us, 1),
            )
        if is_shape and c is not None:
            row.update(rep_medians_us=[round(r, 3) for r in c.rep_medians_us], error=c.error, backend=c.backend)
            if c.kernels:
                row["kernels"] = list(c.kernels)
        if arm != ROUTED:
            s = self.speedup(target, m, arm)
            row["routed_speedup"] = None if s is None else round(s, 4)
        return row

    def rowwise_ratios(self) -> dict[str, dict[int, float]]:
        """Per shape and the layer sum: rowwise CUTLASS time / per-tensor cuBLASLt time (> 1: cuBLASLt faster)."""
        out: dict[str, dict[int, float]] = {}
        for target in self.targets:
            name = target.label if isinstance(target, LayerShape) else SUM
            for m in self.m_values:
                new, old = self.timing(target, m, CUBLAS), self.timing(target, m, ROWWISE)
                if new is not None and old is not None and new.median_us > 0:
                    out.setdefault(name, {})[m] = old.median_us / new.median_us
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "ceilings": self.ceilings.to_json(),
            "arms": self.arms,
            "m_values": self.m_values,
            "shapes": [{"name": s.name, "n": s.n, "k": s.k} for s in self.shapes],
            "rows": self.rows(),
            "violations": self.violations(),
            "twin_gaps": [round(g, 4) for g in self.twin_gaps()],
            "routed_not_timed": self.untimed_routed(),
            "prefill_floor_ratio": {str(m): round(r, 4) for m, r in self.prefill_floor_ratios().items()},
            "rowwise_over_cublas": {
                name: {str(m): round(r, 4) for m, r in by_m.items()} for name, by_m in self.rowwise_ratios().items()
            },
        }

    # --- text ---------------------------------------------------------------------------------

    def text(self) -> str:
        blocks = [self._table(target) for target in self.targets]
        blocks.append(self._rowwise_text())
        blocks.append(self._verdict_text())
        return "\n\n".join(b for b in blocks if b)

    def _table(self, target: LayerShape | str) -> str:
        is_sum = not isinstance(target, LayerShape)
        title = f"{SUM} ({' + '.join(s.name for s in self.shapes)})" if is_sum else target.label  # type: ignore[union-attr]
        width = 12
        head = f"{'M':>6} " + "".join(f"{a:>{width}}" for a in self.arms) + f"{'floor':>9}"
        head += f" | {'TFLOP/s':>8}{'GB/s':>8}{'%floor':>7} | speedup of routed vs " + " ".join(
            f"{p:>11}" for p in self.policies
        )
        lines = [f"{title}   (us, median of cold-L2 calls over 2 reps; routed row: its plan's backend)", head]
        for m in self.m_values:
            line = f"{m:>6} "
            for arm in self.arms:
                t = self.timing(target, m, arm)
                line += f"{_us(t):>{width}}"
            line += f"{self.floor(target, m):>9.1f}"
            routed = self.timing(target, m, ROUTED)
            row = self._row(target, m, ROUTED)
            nan = float("nan")
            line += f" | {row.get('tflops', nan):>8.1f}{row.get('gbs', nan):>8.0f}{row.get('pct_of_floor', nan):>7.1f}"
            line += " | " + " ".join(f"{_x(self.speedup(target, m, p)):>11}" for p in self.policies)
            if not is_sum:
                c = self.cell(target, m, ROUTED)  # type: ignore[arg-type]
                if c is not None and c.backend:
                    line += f"  [{c.backend}]"
            elif routed is not None:
                line += f"  [{routed.median_us / self.floor(target, m):.2f}x floor]"
            lines.append(line)
        return "\n".join(lines)

    def _rowwise_text(self) -> str:
        ratios = self.rowwise_ratios()
        if not ratios:
            return ""
        names = list(ratios)
        width = max(len(n) for n in names) + 2
        lines = [
            "rowwise CUTLASS time / per-tensor cuBLASLt time (> 1: cuBLASLt faster)",
            f"{'M':>6} " + "".join(f"{n:>{width}}" for n in names),
        ]
        for m in self.m_values:
            lines.append(f"{m:>6} " + "".join(f"{_x(ratios[n].get(m)):>{width}}" for n in names))
        return "\n".join(lines)

    def _verdict_text(self) -> str:
        bad = self.violations()
        n_compared = len(self.shapes) + 1
        lines = [
            f"routed vs every single-backend policy within the measured spread (min {self.min_tie:.0%}), "
            f"{len(self.m_values)} M values x {n_compared} (shapes + layer sum): "
            + ("PASS" if not bad else f"FAIL ({len(bad)})")
        ]
        lines += [f"  slower: {v}" for v in bad]
        gaps = sorted(self.twin_gaps())
        if gaps:
            lines.append(
                f"  twin gap (routed vs its own backend's arm, the same kernels timed twice): median "
                f"{gaps[len(gaps) // 2]:+.1%}, range {gaps[0]:+.1%} .. {gaps[-1]:+.1%} over {len(gaps)} points"
            )
        lines += [f"  routed not timed: {u}" for u in self.untimed_routed()]
        ratios = self.prefill_floor_ratios()
        if ratios:
            ok = all(r <= FLOOR_TARGET for r in ratios.values())
            lines.append(
                f"prefill: routed layer sum / floor at M >= {PREFILL_M}: "
                + ", ".join(f"M={m} {r:.3f}x" for m, r in ratios.items())
                + f" (target <= {FLOOR_TARGET}x: {'PASS' if ok else 'FAIL'})"
            )
        return "\n".join(lines)


def _us(t: Timing | None) -> str:
    if t is None:
        return "-"
    return f"{t.median_us:.1f}±{100 * t.spread:.0f}%" if t.median_us < 1e4 else f"{t.median_us:.0f}"


def _x(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3f}x"
