"""The end-to-end bench's arithmetic and output, on CPU (the timing itself runs on a GPU)."""

import importlib.util

from checkpoint_helpers import TINY

from fp8route.bench.e2e import E2ERow, as_json, plot, table, weight_bytes
from fp8route.checkpoint.random import write_random
from fp8route.engine import load_model

ROWS = [
    E2ERow("routed", 1, 1024, 26.0, 39384.0, 3.078, 324.9, 8.03, 2609.0, 0.612),
    E2ERow("bf16", 1, 1024, 24.1, 42573.0, 5.522, 181.1, 15.01, 2718.0, 0.638),
]


def test_weight_bytes_counts_fp8_weights_once_and_float_ones_at_their_width(tmp_path):
    config = {**TINY, "vocab_size": 64}
    fp8 = load_model(write_random(tmp_path / "fp8", config, fp8=True, device="cpu"), device="cpu", max_model_len=8)
    bf16 = load_model(write_random(tmp_path / "bf16", config, fp8=False, device="cpu"), device="cpu", max_model_len=8)
    h, i, layers = TINY["hidden_size"], TINY["intermediate_size"], TINY["num_hidden_layers"]
    heads, kv = TINY["num_attention_heads"], TINY.get("num_key_value_heads", TINY["num_attention_heads"])
    hd = h // heads
    linear = layers * (h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * i)
    rest = 2 * (64 * h + (2 * layers + 1) * h)  # bf16 lm_head and norms
    assert weight_bytes(fp8.module) == linear + rest
    assert weight_bytes(bf16.module) == 2 * linear + rest


def test_table_json_and_plot():
    text = table(ROWS)
    assert text.splitlines()[0].startswith("arm") and "324.9" in text and "61%" in text
    assert "GB/s" in text.splitlines()[0] and " 2609 " in text
    assert as_json(ROWS)[0]["decode_tok_s"] == 324.9


def test_plot_writes_a_png_when_matplotlib_is_there(tmp_path):
    path = plot(ROWS, tmp_path / "e2e.png", "test")
    if importlib.util.find_spec("matplotlib") is None:
        assert path is None
    else:
        assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_scheme_is_put_against_per_tensor_on_the_same_arm_and_shape():
    from dataclasses import replace

    from fp8route.bench.e2e import scheme_summary

    tensor = ROWS[0]
    block = replace(tensor, decode_step_ms=3.3858, ttft_ms=28.6, scheme="block")
    other_shape = replace(block, batch=16, decode_step_ms=9.0)  # no per-tensor row to compare with
    lines = scheme_summary([tensor, block, other_shape, ROWS[1]]).splitlines()
    assert len(lines) == 2 and lines[1].split() == ["routed", "block", "1", "1024", "1.100", "1.100"]
    assert block.label == "routed block" and tensor.label == "routed"


def test_options_and_schemes_each_compare_within_their_own_kind():
    """A run of tensor and block checkpoints, each with quantize_upstream off and on: an option row
    is put against its own scheme's first row, a block row against the tensor row with its options
    (the H100 run of 2026-12-06 compared tensor rows with the block plain row)."""
    from dataclasses import replace

    from fp8route.bench.e2e import options_summary, scheme_summary

    tensor = ROWS[0]
    tensor_on = replace(tensor, decode_step_ms=tensor.decode_step_ms / 2, ttft_ms=tensor.ttft_ms / 4,
                        quantize_upstream=True)  # fmt: skip
    block = replace(tensor, decode_step_ms=tensor.decode_step_ms * 1.5, scheme="block")
    block_on = replace(block, decode_step_ms=block.decode_step_ms / 3, quantize_upstream=True)
    rows = [tensor, block, tensor_on, block_on]
    options = [line.split() for line in options_summary(rows).splitlines()[1:]]
    assert options == [
        ["routed", "quantize-upstream", "1", "1024", "2.000", "4.000", "routed,", "equal"],
        ["routed", "block", "quantize-upstream", "1", "1024", "3.000", "1.000", "routed", "block,", "equal"],
    ]
    schemes = [line.split() for line in scheme_summary(rows).splitlines()[1:]]
    assert schemes == [
        ["routed", "block", "1", "1024", "1.500", "1.000"],
        ["routed", "block", "quantize-upstream", "1", "1024", "1.000", "4.000"],
    ]


def test_pdl_arms_are_labelled_and_the_measured_one_says_which_graphs_kept_it():
    from dataclasses import replace

    from fp8route.bench.e2e import options_summary

    measured = replace(ROWS[0], pdl_choices=((1, True, 3.1, 3.0), (2, False, 3.2, 3.19), (16, False, 3.4, 3.5)))
    off = replace(ROWS[0], pdl=False, decode_step_ms=3.2, tokens_digest="x")
    on = replace(ROWS[0], pdl=True)
    assert (measured.label, off.label, on.label) == ("routed", "routed pdl-off", "routed pdl")
    lines = options_summary([off, on, measured]).splitlines()
    speedup = f"{3.2 / 3.078:.3f}"
    assert lines[1].split() == ["routed", "pdl", "1", "1024", speedup, "1.000", "routed", "pdl-off,", "DIFFER"]
    assert lines[3] == "routed: PDL kept in 1 of 3 decode graphs, batches 1 (1.033x) (replay time without / with)"


def test_rounds_run_the_arms_forward_then_back_and_each_summary_compares_within_a_round():
    """bench e2e --rounds: the arms in order, then reversed, ...; a ratio is taken between rows of one
    round, and a later round's rows say which they are."""
    from dataclasses import replace

    from fp8route.bench.e2e import scheme_summary
    from fp8route.cli.bench_e2e import round_orders

    runs = [(1, "routed", "builtin", None, s, "nccl") for s in ("tensor", "block", "channel")]
    assert round_orders(runs, 3) == [runs, runs[::-1], runs]
    tensor = ROWS[0]
    block = replace(tensor, decode_step_ms=tensor.decode_step_ms * 1.2, scheme="block")
    later = [replace(tensor, decode_step_ms=4.0, round=1), replace(block, decode_step_ms=4.4, round=1)]
    lines = [line.split() for line in scheme_summary([tensor, block, *later]).splitlines()[1:]]
    assert lines == [
        ["routed", "block", "1", "1024", "1.200", "1.000"],
        ["routed", "block", "round", "2", "1", "1024", "1.100", "1.000"],
    ]


def test_each_kv_cache_dtype_asked_for_is_an_arm_and_labels_its_rows(monkeypatch):
    import torch

    from fp8route.cli import build_parser
    from fp8route.cli.bench_e2e import _plan

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # the plan asks for a GPU per rank
    args = build_parser().parse_args(["bench", "e2e", "--random", "llama-3.1-8b", "--kv-cache-dtype", "auto,fp8"])
    assert _plan(args, torch.device("cpu")).kv_dtypes == ["auto", "fp8"]
    assert E2ERow("routed", 64, 4096, 1.0, 1.0, 1.0, 1.0, 8.0, 1.0, 0.5, kv_cache_dtype="fp8").label == "routed kv-fp8"
    assert ROWS[0].label == "routed"


def test_every_kv_cache_dtype_and_arm_is_benched_in_each_round_with_its_own_settings(monkeypatch, capsys):
    from pathlib import Path

    import fp8route.cli.bench_e2e as cli
    from fp8route.bench.e2e import ArmOptions

    calls = []

    def bench_arm(arm, folder, batches, inputs, output, copy_gbs, **kw):
        calls.append((arm, folder.name, kw["kv_cache_dtype"], kw["attention"], kw["tp"]))
        return [E2ERow(arm, 1, 1024, 1.0, 1.0, 1.0, 1.0, 8.0, 1.0, 0.5, kv_cache_dtype=kw["kv_cache_dtype"])]

    monkeypatch.setattr(cli, "bench_arm", bench_arm)
    plan = cli._Plan(["routed", "bf16"], [1], [1024], [1], ["nccl"], ["builtin"], ["auto", "fp8"], [ArmOptions()],
                     ["tensor"])  # fmt: skip
    folders = {"tensor": Path("fp8-tensor"), "bf16": Path("bf16")}
    rows = cli._bench(plan, folders, 8, 1000.0, rounds=2)
    first = [("routed", "fp8-tensor", "auto", "builtin", 1), ("routed", "fp8-tensor", "fp8", "builtin", 1),
             ("bf16", "bf16", "auto", "builtin", 1), ("bf16", "bf16", "fp8", "builtin", 1)]  # fmt: skip
    assert calls == first + first[::-1]
    assert [r.round for r in rows] == [0] * 4 + [1] * 4
    assert [r.label for r in rows[:2]] == ["routed", "routed kv-fp8"]
