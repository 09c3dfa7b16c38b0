"""`fp8route eval --text FILE`: next-token scores over every position of a text, by hand on
models whose logits are set by hand, the sequence-level interval, and the command on a tiny checkpoint."""

import json
import math

import pytest
import torch

from fp8route import quantize_checkpoint
from fp8route.cli import main
from fp8route.evaluation.text import ratio_interval, score_text, summarize_text, text_sequences
from fp8route.models.tokenizer import load_tokenizer


class TableModel:
    """Logits from the current token through a table plus a causal running sum: a padding or
    position mistake would change them."""

    def __init__(self, table: torch.Tensor, causal: float = 0.0) -> None:
        self.table, self.causal = table, causal

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.table[ids].clone()
        logits[..., 1] += self.causal * ids.cumsum(-1).float()
        return logits


SEQUENCES = [torch.tensor(s) for s in ([0, 1, 2, 3, 1, 1], [2, 2, 0], [3, 1], [1, 0, 3, 2, 2, 1, 0])]


def by_hand(reference, model, seq):
    p = reference(seq[None, :-1])[0].log_softmax(-1)
    q = model(seq[None, :-1])[0].log_softmax(-1)
    target = seq[1:]
    return {
        "nll": -q.gather(1, target[:, None]).sum().item(),
        "correct": (q.argmax(-1) == target).sum().item(),
        "kl": (p.exp() * (p - q)).sum().item(),
        "top1": (p.argmax(-1) == q.argmax(-1)).sum().item(),
    }


def test_scores_by_hand_whatever_the_batching():
    torch.manual_seed(0)
    reference, other = TableModel(torch.randn(4, 4), 0.3), TableModel(torch.randn(4, 4), -0.2)
    for batch_size in (1, 3, 4):
        scores = score_text([reference, other], SEQUENCES, batch_size=batch_size)
        assert scores.tokens.tolist() == [5, 2, 1, 6]
        for i, seq in enumerate(SEQUENCES):
            expected = by_hand(reference, other, seq)
            assert scores.nll[1, i].item() == pytest.approx(expected["nll"], rel=1e-5)
            assert scores.kl[1, i].item() == pytest.approx(expected["kl"], rel=1e-5, abs=1e-7)
            assert (scores.correct[1, i].item(), scores.top1[1, i].item()) == (expected["correct"], expected["top1"])
            assert scores.kl[0, i] == 0 and scores.top1[0, i] == scores.tokens[i]


def test_ratio_interval_by_hand():
    sums, tokens = torch.tensor([1.0, 3.0, 2.0]), torch.tensor([2.0, 4.0, 2.0])
    r = ratio_interval(sums, tokens)
    mean = 6 / 8
    residual = torch.tensor([1 - mean * 2, 3 - mean * 4, 2 - mean * 2])
    half = 1.96 * math.sqrt(float((residual**2).sum()) * 3 / 2 / 64)
    assert r["mean"] == mean and r["low"] == pytest.approx(mean - half) and r["high"] == pytest.approx(mean + half)


def test_a_model_agrees_with_itself():
    model = TableModel(torch.randn(4, 4, generator=torch.Generator().manual_seed(1)))
    result = summarize_text("t.txt", 8, score_text([model, model], SEQUENCES), ["a", "b"])
    agree = result["agreement"]["b"]
    assert agree["top1"]["mean"] == 1.0 and agree["mean_kl"]["mean"] == pytest.approx(0.0, abs=1e-7)
    assert result["paired"]["b"]["nll_per_token"]["mean"] == 0.0 and result["predicted_tokens"] == 14


def test_per_sequence_sums_pair_any_two_models():
    g = torch.Generator().manual_seed(2)
    models = [TableModel(torch.randn(4, 4, generator=g), c) for c in (0.3, -0.2, 0.1)]
    scores = score_text(models, SEQUENCES, batch_size=3)
    result = summarize_text("t.txt", 8, scores, ["a", "b", "c"])
    assert result["sequence_tokens"] == [5, 2, 1, 6] and set(result["per_sequence"]["a"]) == {"nll", "correct"}
    tokens = torch.tensor(result["sequence_tokens"], dtype=torch.float64)
    for k, label in ((1, "b"), (2, "c")):
        rows = result["per_sequence"][label]
        assert rows["kl"] == scores.kl[k].tolist() and rows["top1"] == scores.top1[k].tolist()
        kl = torch.tensor(rows["kl"], dtype=torch.float64)
        assert ratio_interval(kl, tokens) == result["agreement"][label]["mean_kl"]
    nll = {label: torch.tensor(result["per_sequence"][label]["nll"], dtype=torch.float64) for label in "bc"}
    b_minus_c = nll["b"] - nll["c"]
    assert ratio_interval(b_minus_c, tokens)["mean"] == pytest.approx(
        float((scores.nll[1] - scores.nll[2]).sum()) / 14, rel=1e-12
    )


TEXT = "\n\n".join(
    f"Passage {k}: the river rose {k} feet overnight, and the town of Elm{k} moved its market uphill."
    for k in range(12)
)


@pytest.fixture(scope="module")
def text_folders(tiny_folders, tmp_path_factory):
    text = tmp_path_factory.mktemp("text") / "heldout.txt"
    text.write_text(TEXT)
    return (*tiny_folders, text)


def test_text_is_packed_and_limited(text_folders):
    bf16, _, text = text_folders
    tokenizer = load_tokenizer(bf16)
    every = [i for doc in TEXT.split("\n\n") for i in tokenizer.encode(doc).ids]
    sequences = text_sequences(text, tokenizer, 32, None)
    assert torch.cat(sequences).tolist() == every and all(len(s) == 32 for s in sequences[:-1])
    assert len(text_sequences(text, tokenizer, 32, 2)) == 2


def test_cli_text_compare(text_folders, tmp_path, capsys):
    bf16, fp8, text = text_folders
    out = tmp_path / "results"
    argv = ["eval", str(bf16), "--compare", str(fp8), "--text", str(text), "--text-seq-len", "32", "--limit", "5"]
    assert main([*argv, "--device", "cpu", "--batch-size", "2", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "text:heldout.txt: 155 predicted tokens in 5 sequences of <= 32" in printed
    assert "fp8 vs bf16: top-1 agreement" in printed and "mean KL(bf16 || fp8)" in printed
    result = json.loads((out / "text-heldout-bf16-vs-fp8.json").read_text())
    agree = result["agreement"]["fp8"]
    assert result["sequences"] == 5 and 0 < agree["top1"]["mean"] <= 1 and agree["mean_kl"]["mean"] > 0
    assert agree["mean_kl"]["low"] <= agree["mean_kl"]["mean"] <= agree["mean_kl"]["high"]
    assert "--text" in result["command"] and result["seconds_per_sequence"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "nothing to evaluate: give --task NAME (repeatable) and/or --text FILE"),
        (["--text", "/nonexistent.txt"], "--text /nonexistent.txt: cannot read it as UTF-8 text"),
        (["--text", "TEXT", "--text-seq-len", "1"], "--text-seq-len must be at least 2 tokens, got 1"),
    ],
)
def test_cli_text_errors_are_one_line(text_folders, tmp_path, capsys, argv, message):
    bf16, _, text = text_folders
    argv = [str(text) if a == "TEXT" else a for a in argv]
    rc = main(["eval", str(bf16), *argv, "--device", "cpu", "--out", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and message in err


def test_cli_many_models_share_one_reference(text_folders, tmp_path, capsys):
    bf16, fp8, text = text_folders
    mse = tmp_path / "fp8_mse"
    quantize_checkpoint(bf16, mse, format="modelopt", device="cpu", input_scale="mse")
    out = tmp_path / "results"
    argv = ["eval", str(bf16), "--compare", str(fp8), "--compare", str(mse), "--text", str(text)]
    assert main([*argv, "--text-seq-len", "32", "--limit", "3", "--device", "cpu", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "fp8 vs bf16: top-1 agreement" in printed and "fp8_mse vs bf16: top-1 agreement" in printed
    result = json.loads((out / "text-heldout-bf16-vs-fp8-fp8_mse.json").read_text())
    assert list(result["models"]) == ["bf16", "fp8", "fp8_mse"] and set(result["agreement"]) == {"fp8", "fp8_mse"}
    assert result["command"].count("--compare") == 2 and set(result["paths"]) == {"bf16", "fp8", "fp8_mse"}
    assert result["routes"]["fp8"]["backends"] == ["cpu_dequant"] and result["routes"]["bf16"]["backends"] == []


def test_cli_backends_skip_what_cannot_run_here(text_folders, tmp_path, capsys):
    _, fp8, text = text_folders
    out = tmp_path / "results"
    argv = ["eval", str(fp8), "--backends", "reference,cublas", "--text", str(text), "--limit", "2"]
    assert main([*argv, "--device", "cpu", "--out", str(out), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "fp8route eval: skipped backend cublas: " in err and "FP8ROUTE_FORCE=cublas cannot run it" in err
    result = json.loads((out / "text-heldout-fp8@reference.json").read_text())
    assert list(result["models"]) == ["fp8@reference"] and "needs a CUDA GPU" in result["skipped_backends"]["cublas"]
    assert "--backends reference,cublas" in result["command"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--backends", "reference", "--compare", "X"], "--backends compares one folder with itself"),
        (["--backends", "turbo"], "--backends turbo: expected names among cublas, "),
        (["--backends", "cublas,rowwise"], "--backends cublas,rowwise: none of them can run"),
    ],
)
def test_cli_backends_errors_are_one_line(text_folders, tmp_path, capsys, argv, message):
    _, fp8, text = text_folders
    rc = main(["eval", str(fp8), "--text", str(text), *argv, "--device", "cpu", "--out", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and message in err[-1] and all(line.startswith("fp8route eval: ") for line in err)
