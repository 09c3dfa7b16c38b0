"""PNG figures of a GEMM sweep. matplotlib is optional: without it the JSON is the result."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from fp8route.models.shapes import LayerShape
from fp8route.tuning.report import ROUTED, SUM, GemmReport

log = logging.getLogger("fp8route")


def plot_speedups(report: GemmReport, path: Path, title: str) -> Path | None:
    """One panel per single-backend policy: its time / routed time vs M, a line per shape and
    one (bold) for the layer sum. Above 1, routing wins."""
    plt = pyplot()
    policies = report.timed_policies()  # no empty panel for a backend absent here
    if plt is None or not policies:
        return None
    cols = min(3, len(policies))
    rows = -(-len(policies) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False, sharey=True)
    for ax, policy in zip(axes.flat, policies):
        for target in report.targets:
            points = [(m, s) for m in report.m_values if (s := report.speedup(target, m, policy)) is not None]
            if points:
                label = target.label if isinstance(target, LayerShape) else SUM
                style = {"color": "black", "lw": 2.5} if target == SUM else {"lw": 1.2}
                ax.plot(*zip(*points), marker="o", ms=3, label=label, **style)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{policy} time / {ROUTED} time")
        ax.set_xlabel("M (tokens)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(policies) :]:
        ax.axis("off")
    axes.flat[0].set_ylabel("speedup of routed")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title)
    return save(fig, plt, path)


def plot_rowwise(report: GemmReport, path: Path, title: str) -> Path | None:
    """Rowwise CUTLASS time / per-tensor cuBLASLt time vs M, per shape."""
    plt = pyplot()
    ratios = report.rowwise_ratios()
    if plt is None or not ratios:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, by_m in ratios.items():
        style = {"color": "black", "lw": 2.5} if name == SUM else {"lw": 1.2}
        ax.plot(list(by_m), list(by_m.values()), marker="o", ms=3, label=name, **style)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("rowwise time / cuBLASLt per-tensor time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title)
    return save(fig, plt, path)


@functools.lru_cache(maxsize=1)  # one warning per process, not one per figure
def pyplot():  # type: ignore[no-untyped-def]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning(
            "matplotlib is not installed: no PNG written (pip install 'fp8route[plot]'); the JSON has every number"
        )
        return None
    return plt


def save(fig, plt, path: Path) -> Path:  # type: ignore[no-untyped-def]
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
