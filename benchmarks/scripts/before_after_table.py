"""The table gpu_before_after.sh prints last: each figure before and after issue 46's restructure, and
their ratio (after / before; within 0.98-1.02 is what the issue asks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def figures(folder: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in ("decode", "prefill"):
        path = folder / f"{name}.json"
        if path.exists():
            report = json.loads(path.read_text())["reports"][0]
            out[f"serve {name}-heavy output tok/s"] = report["output_throughput"]
            out[f"serve {name}-heavy completed"] = report["completed"]
    path = folder / "e2e.json"
    if path.exists():
        for row in json.loads(path.read_text())["rows"]:
            out[f"e2e b1x{row['input_tokens']} decode tok/s"] = row["decode_tok_s"]
            out[f"e2e b1x{row['input_tokens']} TTFT ms"] = row["ttft_ms"]
    return out


def main(out: Path) -> None:
    before, after = figures(out / "before"), figures(out / "after")
    print(f"{'figure':36} {'before':>10} {'after':>10} {'after/before':>12}")
    for key in dict.fromkeys([*before, *after]):  # in the order the figures are read
        b, a = before.get(key), after.get(key)
        ratio = f"{a / b:.3f}" if a is not None and b else "-"
        print(f"{key:36} {b if b is not None else '-':>10} {a if a is not None else '-':>10} {ratio:>12}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
