"""README's table of current figures, rendered from the committed result files under benchmarks/results/.

Each row names the file it reads and how; `fp8route bench figures` prints the table or rewrites it
between README's markers, and a test fails when README's table is not the one these files give, so
the figures cannot drift from the results they cite.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fp8route.errors import Fp8InputError
from fp8route.tuning.report import SUM

BEGIN = "<!-- figures: generated from benchmarks/results by `fp8route bench figures --write`; do not edit -->"
END = "<!-- /figures -->"


@dataclass(frozen=True)
class Figure:
    """One row: what it measures, the result files (relative to the results folder) and how to read them."""

    what: str
    sources: tuple[str, ...]
    read: Callable[..., str]


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _log_number(path: Path, pattern: str) -> float:
    """The first number a regex's group captures in a log file (commas as thousands separators)."""
    match = re.search(pattern, path.read_text())
    if match is None:
        raise Fp8InputError(f"{path}: no line matches {pattern!r}; the figure cannot be read from it")
    return float(match.group(1).replace(",", ""))


def gemm_layer_sum(path: Path) -> str:
    """The routed layer sum at M=1 against the two library backends and the floor (bench gemm's own sum rows)."""
    sums = {r["arm"]: r for r in _json(path)["rows"] if r["m"] == 1 and r["shape"] == SUM}
    return (
        f"routed {sums['routed']['median_us']:.1f} µs; cuBLASLt {sums['cublas']['median_us']:.1f}, "
        f"CUTLASS rowwise {sums['rowwise']['median_us']:.1f}; floor {sums['routed']['floor_us']:.1f}"
    )


def gemm_misses(*paths: Path) -> str:
    """How often, and by how much at most, routed came out slower than a single backend beyond the spread."""
    points, gaps = 0, []
    for path in paths:
        report = _json(path)
        points += len(report["m_values"]) * (len(report["shapes"]) + 1)  # every shape and the layer sum
        for line in report["violations"]:
            routed, best = (float(v) for v in re.findall(r"([\d.]+) us", line)[:2])
            gaps.append(routed / best - 1)
    if not gaps:
        return f"routed at least as fast as every single backend at all {points} points"
    return f"{len(gaps)} of {points} points slower than the best single backend, the largest by {100 * max(gaps):.1f}%"


def e2e_decode(path: Path) -> str:
    row = _json(path)["rows"][0]
    return (
        f"{row['decode_tok_s']:.0f} tok/s ({row['decode_step_ms']:.2f} ms a step, "
        f"{100 * row['floor_fraction']:.0f}% of the weight-read floor)"
    )


def e2e_ttft(path: Path) -> str:
    row = _json(path)["rows"][0]
    return f"{row['ttft_ms']:.0f} ms"


def prefill_heavy(path: Path) -> str:
    lone = _log_number(path, r"routed: input [\d,]+ tok/s = ([\d.]+)x a lone")
    routed = _log_number(path, r"routed: input ([\d,]+) tok/s")
    cublas = _log_number(path, r"cublas: input ([\d,]+) tok/s")
    return f"{lone:.2f}x a lone prefill's speed; routed {routed / cublas:.3f}x cuBLASLt-only"


def decode_heavy(path: Path) -> str:
    share = _log_number(path, r"routed: output [\d,]+ tok/s = ([\d.]+) of the load")
    return f"output tok/s {share:.2f} of the load's own bound"


def poisson_ttft(path: Path) -> str:
    report = _json(path)["reports"][0]
    return f"TTFT p50 {report['ttft_ms']['p50'] / report['extra']['unloaded_ttft_ms']:.2f}x a request alone"


def http_over_offline(http: Path, offline: Path) -> str:
    ratio = _json(http)["reports"][0]["output_throughput"] / _json(offline)["reports"][0]["output_throughput"]
    return f"{ratio:.2f}x offline output tok/s"


def sampling_cost(path: Path) -> str:
    by_arm = {r["extra"]["sampling"]: r["output_throughput"] for r in _json(path)["reports"]}
    greedy = by_arm["greedy"]
    mixed, schema = by_arm["mixed"] / greedy, by_arm["json"] / greedy
    return f"mixed controls {mixed:.2f}x greedy's output tok/s, JSON schema {schema:.2f}x"


def schemes_vs_tensor(path: Path) -> str:
    """Each scheme's batch-1 decode step and TTFT as a multiple of per-tensor's in the same run (the
    file holds runs by commit, oldest first; a scheme's last run is the one read)."""
    latest: dict[str, tuple[dict, dict]] = {}
    for run in _json(path).values():
        rows = {row["scheme"]: row for row in run["rows"]}
        latest.update({scheme: (row, rows["tensor"]) for scheme, row in rows.items() if scheme != "tensor"})
    parts = [
        f"{scheme}: decode step {row['decode_step_ms'] / tensor['decode_step_ms']:.2f}x, "
        f"TTFT {row['ttft_ms'] / tensor['ttft_ms']:.2f}x"
        for scheme, (row, tensor) in sorted(latest.items(), key=lambda item: item[0] != "channel")
    ]
    return "; ".join(parts) + " per-tensor's in the same run"


def deterministic_cost(path: Path) -> str:
    """The deterministic mode's decode step (batch 1 and 16) and TTFT (batch 1) as a multiple of the
    routed arm's in the same run."""
    rows = {(r["arm"], r["batch"]): r for r in _json(path)["rows"]}
    step = [rows["deterministic", b]["decode_step_ms"] / rows["routed", b]["decode_step_ms"] for b in (1, 16)]
    ttft = rows["deterministic", 1]["ttft_ms"] / rows["routed", 1]["ttft_ms"]
    tokens = rows["routed", 1]["input_tokens"]
    return (
        f"decode step {step[0]:.2f}x at batch 1, {step[1]:.2f}x at 16; TTFT {ttft:.2f}x at {tokens} tokens, "
        "against routed in the same run"
    )


FIGURES = (
    Figure("GEMMs, layer sum at M=1", ("h200/routing/retuned3/gemm-llama-3.1-8b-tp1.json",), gemm_layer_sum),
    Figure(
        "GEMMs benched in a fresh process, TP1 and TP4",
        ("h200/routing/recheck5/gemm-llama-3.1-8b-tp1.json", "h200/routing/recheck5/gemm-llama-3.1-8b-tp4.json"),
        gemm_misses,
    ),
    Figure("Decode at batch 1", ("h200/engine/run5_e2e/e2e-ckpt-8b.json",), e2e_decode),
    Figure("TTFT, 4096 tokens", ("h200/engine/run5_e2e/e2e-ckpt-8b.json",), e2e_ttft),
    Figure("Serving, prefill-heavy load", ("h200/engine/run4_serve/prefill.log",), prefill_heavy),
    Figure("Serving, decode-heavy load", ("h200/engine/run4_serve/decode.log",), decode_heavy),
    Figure(
        "Serving, Poisson arrivals at 72% of capacity", ("h200/engine/run4_serve/serve-ckpt-8b.json",), poisson_ttft
    ),
    Figure(
        "Serving over HTTP, decode-heavy load",
        (
            "h200/serve_http/run5_engine_process/decode-http.json",
            "h200/serve_http/run5_engine_process/decode-offline.json",
        ),
        http_over_offline,
    ),
    Figure("Sampling controls, decode-heavy load", ("h200/sampling/serve-ckpt-8b.json",), sampling_cost),
    Figure("Channel and block FP8, batch 1 and TTFT 4096", ("h200/schemes/e2e.json",), schemes_vs_tensor),
    Figure("Deterministic mode (batch-invariant tokens)", ("h200/deterministic/e2e.json",), deterministic_cost),
)


def render(results: Path, figures: tuple[Figure, ...] = FIGURES) -> str:
    """The markdown table, one row per figure, each naming the folder it was read from."""
    lines = ["| figure (one H200, Llama-3.1-8B dimensions) | measured | result |", "|---|---|---|"]
    for figure in figures:
        paths = [results / source for source in figure.sources]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise Fp8InputError(f"figure {figure.what!r}: no {', '.join(missing)}; run from the repository root")
        folder = Path(figure.sources[0]).parent
        lines.append(f"| {figure.what} | {figure.read(*paths)} | `benchmarks/results/{folder}/` |")
    return "\n".join(lines)


def replace_table(readme: str, table: str) -> str:
    """README's text with the block between the markers replaced by `table`."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1:
        raise Fp8InputError(f"README must hold the figures markers once each: {BEGIN} ... {END}")
    head, rest = readme.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def table_in(readme: str) -> str:
    """The table README holds between the markers."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1:
        raise Fp8InputError(f"README must hold the figures markers once each: {BEGIN} ... {END}")
    return readme.split(BEGIN)[1].split(END)[0].strip("\n")
