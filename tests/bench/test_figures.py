"""README's figures table is the one the committed results give, and each figure reads what it names."""

import json
from pathlib import Path

import pytest

from fp8route.bench import figures
from fp8route.errors import Fp8InputError

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def test_readme_table_is_the_one_the_committed_results_give():
    readme = (ROOT / "README.md").read_text()
    assert figures.table_in(readme) == figures.render(RESULTS), "run `fp8route bench figures --write`"


def test_every_figure_names_a_committed_file():
    for figure in figures.FIGURES:
        for source in figure.sources:
            assert (RESULTS / source).is_file(), source


def test_a_missing_result_is_one_line_naming_it(tmp_path):
    with pytest.raises(Fp8InputError, match="no .*retuned3/gemm-llama-3.1-8b-tp1.json"):
        figures.render(tmp_path)


def test_misses_count_every_shape_and_layer_sum_and_give_the_largest_gap(tmp_path):
    report = {
        "m_values": [1, 2, 4],
        "shapes": [{"name": "a"}, {"name": "b"}],
        "violations": [
            "a M=2: routed 11.0 us vs cublas 10.0 us (spreads 0.3%, 0.9%; twin gap 0.1%)",
            "layer sum M=4: routed 20.4 us vs fp8_gemv 20.0 us (spreads 1.7%, 1.2%; twin gap 0.1%)",
        ],
    }
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps(report))
    assert figures.gemm_misses(path) == "2 of 9 points slower than the best single backend, the largest by 10.0%"
    path.write_text(json.dumps(report | {"violations": []}))
    assert figures.gemm_misses(path, path) == "routed at least as fast as every single backend at all 18 points"


def test_a_log_without_the_line_is_refused_by_name(tmp_path):
    log = tmp_path / "prefill.log"
    log.write_text("routed: input 52,491 tok/s = 0.92x a lone 4096-token prefill (57,163 tok/s)\n")
    with pytest.raises(Fp8InputError, match="prefill.log: no line matches"):
        figures.prefill_heavy(log)  # no cublas arm in it
    log.write_text(log.read_text() + "cublas: input 51,227 tok/s = 0.93x a lone 4096-token prefill\n")
    assert figures.prefill_heavy(log) == "0.92x a lone prefill's speed; routed 1.025x cuBLASLt-only"


def test_replace_table_keeps_the_text_around_the_markers():
    readme = f"intro\n{figures.BEGIN}\nold\n{figures.END}\noutro\n"
    new = figures.replace_table(readme, "| a |")
    assert new == f"intro\n{figures.BEGIN}\n| a |\n{figures.END}\noutro\n"
    assert figures.table_in(new) == "| a |"
    with pytest.raises(Fp8InputError, match="markers"):
        figures.replace_table("no markers", "| a |")


def test_each_scheme_is_read_from_its_last_run_against_that_runs_per_tensor_row(tmp_path):
    def row(scheme: str, step: float, ttft: float) -> dict:
        return {"scheme": scheme, "decode_step_ms": step, "ttft_ms": ttft}

    runs = {
        "old": {"rows": [row("tensor", 3.0, 70.0), row("channel", 5.0, 77.0), row("block", 3.6, 84.0)]},
        "new": {"rows": [row("tensor", 2.0, 80.0), row("channel", 2.2, 84.0)]},
    }
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(runs))
    assert figures.schemes_vs_tensor(path) == (
        "channel: decode step 1.10x, TTFT 1.05x; block: decode step 1.20x, TTFT 1.20x per-tensor's in the same run"
    )
