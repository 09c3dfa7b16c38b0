"""Summaries of a task's scores: each model's metrics with a 95% interval, and, for two models
scored on the same examples, the paired difference and how far their next-token distributions
moved apart.

Pairing matters: two checkpoints of one model get most examples right or wrong together, so the
standard error of the per-example difference is far smaller than either accuracy's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fp8route.evaluation.scoring import Scores, example_metrics
from fp8route.evaluation.tasks import Task

Z95 = 1.96


def mean_interval(values: Sequence[float]) -> dict[str, float]:
    """Mean and its normal 95% interval (mean ± 1.96 sd / sqrt(n), sd with n - 1)."""
    n = len(values)
    mean = sum(values) / n if n else math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    half = Z95 * sd / math.sqrt(n) if n else math.nan
    return {"mean": mean, "low": mean - half, "high": mean + half, "sd": sd, "n": n}


def score_interval(values: Sequence[float]) -> dict[str, float]:
    """mean_interval, except for right/wrong scores (every value 0 or 1): there the Wilson score
    interval, which stays inside [0, 1] where the normal one runs past it at small n."""
    if not values or any(v not in (0, 1) for v in values):
        return mean_interval(values)
    result = mean_interval(values)
    n, p, z2 = len(values), result["mean"], Z95 * Z95
    center = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return result | {"low": center - half, "high": center + half}


def paired_difference(reference: Sequence[float], other: Sequence[float]) -> dict[str, float]:
    """other - reference per example, its mean and 95% interval."""
    if len(reference) != len(other):
        raise ValueError(f"paired values need equal lengths, got {len(reference)} and {len(other)}")
    return mean_interval([b - a for a, b in zip(reference, other, strict=True)])


def summarize(task: Task, scores: Scores, labels: Sequence[str]) -> dict[str, Any]:
    """The JSON-ready results of one task: per model its metrics (mean and interval) and, with a
    second model, the paired differences, top-1 agreement and mean KL over scored tokens."""
    per_model = [example_metrics(task, scores.logprob[m]) for m in range(len(labels))]
    total_tokens = int(scores.tokens.sum())
    result: dict[str, Any] = {
        "task": task.name,
        "kind": task.kind,
        "n": len(task.examples),
        "requests": int(scores.tokens.numel()),
        "scored_tokens": total_tokens,
        "source": task.source,
        "prompt": task.prompt,
        "models": {
            label: {name: score_interval(values) for name, values in metrics.items()}
            for label, metrics in zip(labels, per_model, strict=True)
        },
        "per_example": {label: metrics for label, metrics in zip(labels, per_model, strict=True)},
    }
    if len(labels) > 1:
        ref = per_model[0]
        result["paired"] = {
            label: {name: paired_difference(ref[name], values) for name, values in metrics.items()}
            for label, metrics in zip(labels[1:], per_model[1:], strict=True)
        }
        result["agreement"] = {
            label: {
                "top1": int(scores.top1[m].sum()) / total_tokens,
                "mean_kl": float(scores.kl[m].sum()) / total_tokens,
                "max_request_mean_kl": float((scores.kl[m] / scores.tokens).max()),
            }
            for m, label in enumerate(labels)
            if m > 0
        }
    return result


def pairwise(per_example: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Every pair's paired differences ("b - a" for labels a before b), metric by metric."""
    labels = list(per_example)
    return {
        f"{b} - {a}": {name: paired_difference(per_example[a][name], per_example[b][name]) for name in per_example[a]}
        for i, a in enumerate(labels)
        for b in labels[i + 1 :]
    }


def _pct(x: float, scale: float) -> str:
    return f"{x * scale:.4f}" if scale == 1 else f"{x * scale:5.1f}"


def _paired_text(d: dict[str, float], scale: float) -> str:
    """A paired difference and its interval; where every example's difference is the same (two models
    right and wrong on the same items), that, since an interval of width 0 would claim certainty."""
    dp = 4 if scale == 1 else 2
    if d["n"] > 1 and d["sd"] == 0:
        return f"{d['mean'] * scale:+.{dp}f} on every one of the {d['n']} items"
    return f"{d['mean'] * scale:+.{dp}f} [{d['low'] * scale:+.{dp}f}, {d['high'] * scale:+.{dp}f}]"


def format_summary(result: dict[str, Any]) -> str:
    """A few lines for the terminal: one per model, its metrics with their intervals, then (after
    the first) the paired differences from the first, top-1 agreement and KL."""
    labels = list(result["models"])
    metrics = list(result["models"][labels[0]])
    lines = [f"{result['task']}: n={result['n']} ({result['requests']} requests, {result['scored_tokens']} tokens)"]
    width = max(len(label) for label in labels)
    for k, label in enumerate(labels):
        cells = []
        for name in metrics:
            scale, unit = (1.0, "") if name == "bits_per_byte" else (100.0, "%")
            s = result["models"][label][name]
            cell = f"{name} {_pct(s['mean'], scale)}{unit} [{_pct(s['low'], scale)}, {_pct(s['high'], scale)}]"
            if k:
                cell += " diff " + _paired_text(result["paired"][label][name], scale)
            cells.append(cell)
        if k:
            agree = result["agreement"][label]
            cells.append(
                f"top-1 agreement {agree['top1'] * 100:.2f}%, mean KL({labels[0]} || {label}) {agree['mean_kl']:.4f}"
            )
        lines.append(f"  {label:<{width}}  " + "   ".join(cells))
    return "\n".join(lines)
