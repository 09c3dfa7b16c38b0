"""Markdown tables from the JSON files `fp8route eval` wrote under a folder (gpu_eval.sh's results):
per task, each model against the first (accuracy, paired difference, ratio to the reference, top-1
agreement, KL); the --text results; and the --backends runs, each backend against the first.

    python3 benchmarks/scripts/eval_table.py RESULTS_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _record(path: str) -> dict[str, Any]:
    """A folder's quantization_config.fp8route, or {} (bf16, or not made by fp8route quantize)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    record = (config.get("quantization_config") or {}).get("fp8route")
    return record if isinstance(record, dict) else {}


def _kept(result: dict[str, Any], label: str) -> str:
    record = _record(result.get("paths", {}).get(label, ""))
    if not record:
        return "-"
    kept = str(len(record.get("kept_float", [])))
    budget = record.get("kl_budget")
    if isinstance(budget, dict):
        kept += f" (KL {budget.get('achieved_kl', float('nan')):.4f} <= {budget.get('budget')} on calib)"
    return kept


def _pct(s: dict[str, float]) -> str:
    return f"{s['mean'] * 100:.2f}"


def _diff(d: dict[str, float], scale: float = 100.0, digits: int = 2) -> str:
    return f"{d['mean'] * scale:+.{digits}f} [{d['low'] * scale:+.{digits}f}, {d['high'] * scale:+.{digits}f}]"


def task_table(result: dict[str, Any], backends: bool = False) -> list[str]:
    labels = list(result["models"])
    metrics = [m for m in ("acc", "acc_norm") if m in result["models"][labels[0]]]
    head = ["backend" if backends else "model", *([] if backends else ["kept in bf16"])]
    for m in metrics:
        head += [m, f"diff {m} (pts, 95%)", f"{m} / {labels[0]}"]
    head += ["top-1 agreement", "mean KL"]
    lines = [
        f"### {result['task']}: n={result['n']} ({result['requests']} requests), {result.get('seconds', 0):.0f} s",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for k, label in enumerate(labels):
        row = [label, *([] if backends else [_kept(result, label)])]
        for m in metrics:
            s = result["models"][label][m]
            ref = result["models"][labels[0]][m]["mean"]
            diff = _diff(result["paired"][label][m]) if k else "-"
            row += [_pct(s), diff, f"{s['mean'] / ref:.4f}" if k and ref else "-"]
        agree = result.get("agreement", {}).get(label)
        row += [f"{agree['top1'] * 100:.2f}%", f"{agree['mean_kl']:.4f}"] if agree else ["-", "-"]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def text_table(result: dict[str, Any], backends: bool = False) -> list[str]:
    labels = list(result["models"])
    lines = [
        f"### {result['task']}: {result['predicted_tokens']} predicted tokens in {result['sequences']} sequences "
        f"of <= {result['seq_len']}, {result.get('seconds', 0):.0f} s",
        "",
        "| model | kept in bf16 | NLL/token | diff NLL (95%) | next-token acc | top-1 agreement (95%) | mean KL (95%) |"
        "\n|---|---|---|---|---|---|---|",
    ]
    for k, label in enumerate(labels):
        model = result["models"][label]
        row = [label, "-" if backends else _kept(result, label), f"{model['nll_per_token']['mean']:.4f}"]
        row.append(_diff(result["paired"][label]["nll_per_token"], 1.0, 4) if k else "-")
        row.append(_pct(model["next_token_acc"]))
        if k:
            top1, kl = result["agreement"][label]["top1"], result["agreement"][label]["mean_kl"]
            row += [f"{top1['mean'] * 100:.2f}% [{top1['low'] * 100:.2f}, {top1['high'] * 100:.2f}]"]
            row += [f"{kl['mean']:.4f} [{kl['low']:.4f}, {kl['high']:.4f}]"]
        else:
            row += ["-", "-"]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    results = []
    for path in sorted(root.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(data, dict) and "task" in data and "models" in data:
            results.append(data)
    if not results:
        print(f"no fp8route eval results under {root}")
        return
    for backends in (False, True):
        chosen = [r for r in results if ("skipped_backends" in r) == backends]
        if not chosen:
            continue
        print("## " + ("one FP8 model under each forced backend" if backends else "FP8 vs bf16") + "\n")
        for result in chosen:
            table = text_table if result.get("kind") == "text" else task_table
            print("\n".join(table(result, backends)) + "\n")
        if backends:
            skipped = chosen[0].get("skipped_backends", {})
            for name, why in skipped.items():
                print(f"- skipped {name}: {why}")
            for label, route in chosen[0].get("routes", {}).items():
                fallbacks = "; ".join(route.get("fallbacks", [])) or "none"
                print(f"- {label}: planned {', '.join(route.get('backends', []))}; fallbacks: {fallbacks}")
            print()


if __name__ == "__main__":
    main()
