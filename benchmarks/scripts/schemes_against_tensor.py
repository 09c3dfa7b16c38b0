"""Each FP8 arm against per-tensor ("tensor") from the JSONs cpu_schemes_accuracy.sh's eval wrote: per task the paired
accuracy differences (points, 95%); on the held-out text the KL and top-1 differences paired over
sequences, and over every window of W consecutive sequences the ratio KL(bf16 || arm) / KL(bf16 ||
tensor) and whether the arm's top-1 agreement is above per-tensor's (what the margin of
tests/evaluation/test_schemes_accuracy.py rests on).

    python3 benchmarks/scripts/schemes_against_tensor.py [W ...]    # default: 1 2 4
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from fp8route.evaluation.compare import paired_difference
from fp8route.evaluation.text import ratio_interval

HERE = Path(__file__).parents[1] / "results" / "cpu" / "schemes_accuracy"
for task_path in sorted(HERE.glob("*.json")):
    task = json.loads(task_path.read_text())
    if task.get("kind") != "multiple_choice":
        continue
    print(f"{task['task']} (n={task['n']}), arm - tensor, paired (points, 95%):")
    per_example = task["per_example"]
    for arm in [label for label in list(per_example)[1:] if label != "tensor"]:
        cells = []
        for metric, values in per_example[arm].items():
            d = paired_difference(per_example["tensor"][metric], values)
            cells.append(f"{metric} {d['mean'] * 100:+.2f} [{d['low'] * 100:+.2f}, {d['high'] * 100:+.2f}]")
        print(f"  {arm:16} " + ", ".join(cells))
    print()
(PATH,) = HERE.glob("text-*.json")
result = json.loads(PATH.read_text())
tokens = torch.tensor(result["sequence_tokens"], dtype=torch.float64)
rows = {
    label: {name: torch.tensor(sums, dtype=torch.float64) for name, sums in sequence.items()}
    for label, sequence in result["per_sequence"].items()
}
arms = [label for label in rows if "kl" in rows[label] and label != "tensor"]
print(f"{PATH.name}: {len(tokens)} sequences, {int(tokens.sum())} predicted tokens")
print("\npaired over sequences, arm - tensor (95%):")
for arm in arms:
    kl = ratio_interval(rows[arm]["kl"] - rows["tensor"]["kl"], tokens)
    top1 = ratio_interval(rows[arm]["top1"] - rows["tensor"]["top1"], tokens)
    ratio = float(rows[arm]["kl"].sum() / rows["tensor"]["kl"].sum())
    print(
        f"  {arm:16} KL {kl['mean']:+.4f} [{kl['low']:+.4f}, {kl['high']:+.4f}] (ratio {ratio:.3f}), "
        f"top-1 {top1['mean'] * 100:+.2f} [{top1['low'] * 100:+.2f}, {top1['high'] * 100:+.2f}] pts"
    )
for i, first in enumerate(arms):
    for second in arms[i + 1 :]:
        kl = ratio_interval(rows[second]["kl"] - rows[first]["kl"], tokens)
        print(f"  {second} - {first}: KL {kl['mean']:+.4f} [{kl['low']:+.4f}, {kl['high']:+.4f}]")
for w in [int(a) for a in sys.argv[1:]] or [1, 2, 4]:
    print(f"\nwindows of {w} consecutive sequence(s):")
    for arm in arms:
        spans = [slice(i, i + w) for i in range(len(tokens) - w + 1)]
        ratios = [float(rows[arm]["kl"][s].sum() / rows["tensor"]["kl"][s].sum()) for s in spans]
        better = sum(float(rows[arm]["top1"][s].sum()) > float(rows["tensor"]["top1"][s].sum()) for s in spans)
        ordered = sorted(ratios)
        print(
            f"  {arm:16} KL ratio first {ratios[0]:.3f}, median {ordered[len(ordered) // 2]:.3f}, "
            f"max {ordered[-1]:.3f}, <= 0.80 in {sum(r <= 0.80 for r in ratios)}/{len(ratios)}; "
            f"top-1 above tensor's in {better}/{len(ratios)}"
        )
