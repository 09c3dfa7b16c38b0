"""--kl-budget: the search over prefixes of the sensitivity ranking, the KL it reports against the
written checkpoint run for real, the record, inspect, and the one-line errors."""

import json
import math

import pytest
import torch
from checkpoint_helpers import TINY, llama_tensors, write_checkpoint

from fp8route import Fp8InputError, load_checkpoint, quantize_checkpoint
from fp8route.checkpoint.calibration import generated_token_ids
from fp8route.checkpoint.load import read_plain
from fp8route.checkpoint.sensitivity import max_trials, search_budget
from fp8route.cli import main
from fp8route.loading import model_from_checkpoint
from fp8route.models.llama import LlamaConfig, LlamaForCausalLM

RANKED = [f"linear{i}" for i in range(14)]


def kl_of(kept: int) -> float:
    return 0.1 * 0.7**kept  # falls as more are kept


@pytest.mark.parametrize("budget", [1.0, 0.1, 0.05, 0.01, 0.1 * 0.7**13])
def test_search_keeps_the_shortest_measured_prefix(budget):
    measured: list[int] = []
    found = search_budget(RANKED, budget, lambda k: measured.append(k) or kl_of(k))
    fewest = next(k for k in range(len(RANKED)) if kl_of(k) <= budget)
    assert found.kept == RANKED[:fewest] and found.kl == kl_of(fewest) <= budget
    assert [t.kept for t in found.trials] == measured and len(measured) <= max_trials(len(RANKED)) == 6
    assert (fewest, found.kl) in [(t.kept, t.kl) for t in found.trials]  # only a measured prefix is chosen


def test_search_says_when_no_fp8_model_meets_the_budget():
    with pytest.raises(Fp8InputError, match=r"keeping 13 of the 14 linears in bf16 still gives KL 0\.00097"):
        search_budget(RANKED, 0.0005, kl_of)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("src") / "bf16", llama_tensors(TINY), TINY)


def model_kl(source, dst) -> float:
    """Mean KL(bf16 || fp8) per position, the written checkpoint loaded and run as eval runs it."""
    reference = LlamaForCausalLM(LlamaConfig.from_hf(TINY), {}, read_plain(source, torch.device("cpu"), None))
    quantized = model_from_checkpoint(load_checkpoint(dst, device="cpu"))
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in generated_token_ids(TINY["vocab_size"]):
            p = reference(ids[None], dtype=torch.float32).log_softmax(-1)[0]
            q = quantized(ids[None], dtype=torch.float32).log_softmax(-1)[0]
            total += float((p.exp() * (p - q)).sum())
            count += p.shape[0]
    return total / count


def test_budget_is_met_on_the_written_model(source, tmp_path):
    unbounded = quantize_checkpoint(source, tmp_path / "all", device="cpu", kl_budget=10.0)
    assert unbounded.kept_float == [] and len(unbounded.kl_search.trials) == 1
    kl_all = unbounded.kl_search.kl
    assert kl_all > 0 and kl_all == pytest.approx(model_kl(source, tmp_path / "all"), rel=1e-4)

    budget = kl_all / 4
    report = quantize_checkpoint(source, tmp_path / "some", device="cpu", kl_budget=budget)
    search = report.kl_search
    kept = report.kept_float
    ranked = sorted(report.choices, key=lambda n: report.choices[n].rel_error, reverse=True)
    assert 0 < len(kept) < len(ranked) and kept == ranked[: len(kept)]
    assert search.kl <= budget and search.kl == pytest.approx(model_kl(source, tmp_path / "some"), rel=1e-4)
    assert len(search.trials) <= max_trials(len(ranked))
    # The prefix one shorter was measured over the budget (the boundary the search stops at).
    assert any(t.kept == len(kept) - 1 and t.kl > budget for t in search.trials)

    record = json.loads((tmp_path / "some" / "config.json").read_text())["quantization_config"]["fp8route"]
    assert record["kept_float"] == kept and set(record["sensitivity"]["kept"]) == set(kept)
    assert record["kl_budget"]["budget"] == budget and record["kl_budget"]["kept"] == kept
    assert record["kl_budget"]["achieved_kl"] == search.kl and record["kl_budget"]["tokens"] == 512
    assert len(record["kl_budget"]["trials"]) == len(search.trials)


def test_trial_model_matches_a_fused_checkpoint_with_biases(tmp_path):
    """q/k/v with biases (Qwen2-style) fuse with their biases in the trial as on load."""
    tensors = llama_tensors(TINY)
    g = torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]:
        tensors[name.replace(".weight", ".bias")] = (0.1 * torch.randn(tensors[name].shape[0], generator=g)).bfloat16()
    source = write_checkpoint(tmp_path / "bf16", tensors, TINY)
    report = quantize_checkpoint(source, tmp_path / "fp8", device="cpu", kl_budget=10.0)
    assert "model.layers.0.self_attn.qkv_proj" in load_checkpoint(tmp_path / "fp8", device="cpu").linears
    assert report.kl_search.kl == pytest.approx(model_kl(source, tmp_path / "fp8"), rel=1e-4)


def test_cli_kl_budget_record_and_inspect(source, tmp_path, capsys):
    dst = tmp_path / "fp8"
    assert main(["quantize", str(source), str(dst), "--format", "modelopt", "--kl-budget", "5e-6", "--quiet"]) == 0
    out = capsys.readouterr().out
    record = json.loads((dst / "config.json").read_text())["quantization_config"]["fp8route"]
    kept, search = record["kept_float"], record["kl_budget"]
    assert kept and search["achieved_kl"] <= 5e-6 and math.isfinite(search["achieved_kl"])
    line = f"KL budget 5e-06: mean KL {search['achieved_kl']:.4g} on the calibration tokens, "
    assert f"kept in float: {len(kept)} (" in out and line in out
    excluded = out.split(" excluded (", 1)[1].split("), ", 1)[0]  # at most 8 names, then a count
    assert excluded.count(", ") <= 8 and (len(kept) + 1 <= 8 or "more in config.json" in excluded)
    assert main(["inspect", str(dst), "--device", "cpu"]) == 0
    shown = capsys.readouterr().out
    assert line in shown and kept[0] in shown


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kl-budget", "-0.1"], "kl_budget must be a finite KL in nats >= 0, got -0.1"),
        (["--kl-budget", "nan"], "kl_budget must be a finite KL in nats >= 0, got nan"),
        (["--kl-budget", "0"], "kl_budget=0.0 cannot be met with any linear in FP8: keeping 13 of the 14 linears"),
    ],
)
def test_cli_bad_budget_is_one_line(source, tmp_path, capsys, argv, message):
    rc = main(["quantize", str(source), str(tmp_path / "x"), "--format", "modelopt", "--quiet", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and err.startswith("fp8route quantize: ") and message in err
    assert not (tmp_path / "x").exists()


def test_keep_float_and_kl_budget_exclude_each_other(source, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "quantize",
                str(source),
                str(tmp_path / "x"),
                "--format",
                "modelopt",
                "--keep-float",
                "2",
                "--kl-budget",
                "1",
            ]
        )
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(Fp8InputError, match="not both"):
        quantize_checkpoint(source, tmp_path / "y", device="cpu", keep_float=2, kl_budget=1.0)
