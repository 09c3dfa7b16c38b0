"""The `_H200_BLOCK` entries a block_decode_sweep.json measured: per shape and M, the best swept config
where it beat today's by more than 1% in the graph timing. Prints the literal; `--write` puts it into
fp8route/kernels/decode_gemm/configs.py in place of the current `_H200_BLOCK` assignment.

    python3 benchmarks/scripts/block_table_entries.py $OUT/block_decode_sweep.json [--write]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from fp8route.bench.decode import SHAPES

CONFIGS = Path(__file__).resolve().parents[2] / "fp8route/kernels/decode_gemm/configs.py"
_ASSIGN = re.compile(r"^_H200_BLOCK: .*?^(?=# Measured tables)", re.S | re.M)


def _literal(cfg: dict) -> str:
    args = [str(cfg[f]) for f in ("block_n", "block_k", "block_m", "split_k", "num_warps", "num_stages")]
    if cfg["cuda_core"]:
        args.append("cuda_core=True")
    if cfg["maxnreg"]:
        args.append(f"maxnreg={cfg['maxnreg']}")
    return f"C({', '.join(args)})"


def entries(sweep: dict) -> dict[tuple[int, int], list[tuple[int, str, float]]]:
    """(N, K) -> [(m, config literal, speedup over today's)] for the graph rows the best config won."""
    out: dict[tuple[int, int], list[tuple[int, str, float]]] = {}
    for row in sweep["table"]:
        if row["timing"] == "graph" and row["block_best"] < 0.99 * row["block_today"]:
            gain = row["block_today"] / row["block_best"]
            out.setdefault(SHAPES[row["shape"]], []).append((row["m"], _literal(row["best"]), gain))
    return out


def render(found: dict[tuple[int, int], list[tuple[int, str, float]]]) -> str:
    lines = ["_H200_BLOCK: dict[tuple[int, int], tuple[tuple[int, DecodeConfig], ...]] = {"]
    for (n, k), rows in sorted(found.items()):
        gains = ", ".join(f"M={m} {g:.2f}x" for m, _, g in rows)
        lines.append(f"    ({n}, {k}): (  # over the heuristic: {gains}")
        lines += [f"        ({m}, {lit})," for m, lit, _ in sorted(rows)]
        lines.append("    ),")
    lines.append("}  # fmt: skip" if found else "}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    text = render(entries(json.loads(args.sweep.read_text())))
    print(text, end="")
    if args.write:
        source = CONFIGS.read_text()
        new, count = _ASSIGN.subn(text, source)
        if count != 1:
            raise SystemExit(f"{CONFIGS}: found {count} _H200_BLOCK assignments, expected one")
        CONFIGS.write_text(new)


if __name__ == "__main__":
    main()
