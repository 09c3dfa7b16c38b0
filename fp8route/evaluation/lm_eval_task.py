"""Export fp8route's evaluation tasks as lm-evaluation-harness tasks read from local files.

`lm_eval --model local-completions --include_path FOLDER --tasks NAME` then scores, through
`fp8route serve`, exactly the (context, continuation) strings that `fp8route eval` scores in-process,
so the two numbers can be compared: the server's echo + logprobs path against the direct forward.

A multiple-choice task becomes FOLDER/NAME.jsonl (one row per example) and FOLDER/NAME.yaml. lm-eval
joins context and choice with its target_delimiter " "; fp8route's continuations carry that leading
space, so the rows hold the choices without it and the delimiter stays " ": the strings are the same
and lm-eval's acc_norm divides by the same choice lengths (without the space) as fp8route's does.
Winogrande-style tasks (one context per choice, one shared continuation) use lm-eval's "multiple
input" form: doc_to_text gives the gold index, doc_to_choice the contexts.

The generation task (for `--model local-chat-completions --apply_chat_template`) takes gsm8k_bpb's
OLMES prompts (8-shot "Question: ...\\nAnswer:") and the number after "So the answer is" of the
reference chain of thought as the target, scored by exact_match as lm-eval's gsm8k-cot scores it.

The YAML is written as top-level keys with JSON values (JSON is YAML), so no YAML library is needed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fp8route.errors import Fp8InputError
from fp8route.evaluation.tasks import Example, Task

PREFIX = "fp8route_"
ANSWER = re.compile(r"So the answer is (-? ?[0-9.,]+)\.?\s*$")  # two references say "- 10"
# lm-eval's gsm8k-cot "strict-match", on OLMES's wording ("So the answer is N.").
STRICT_MATCH = r"So the answer is (\-?[0-9\.\,]+)."
STOP = ["Question:", "\n\n"]  # the next shot starts after a blank line; chat-completions keeps 4 stops at most


def lm_eval_name(task: Task, suffix: str = "") -> str:
    """The lm-eval task name (and file stem) of an exported fp8route task: fp8route_<name><suffix>."""
    return re.sub(r"[^A-Za-z0-9_]", "_", f"{PREFIX}{task.name}{suffix}")


def _is_multiple_input(task: Task) -> bool:
    """Whether the choices differ in their contexts (winogrande) rather than in their continuations."""
    return any(len({r.context for r in ex.requests}) > 1 for ex in task.examples)


def _choice_texts(ex: Example) -> list[str]:
    """The continuations without the leading space that lm-eval's target_delimiter puts back."""
    texts = []
    for r in ex.requests:
        if not r.continuation.startswith(" "):
            raise Fp8InputError(f"{ex.id}: continuation {r.continuation[:40]!r} does not start with a space")
        texts.append(r.continuation[1:])
    return texts


def _choice_row(ex: Example, acc_norm: bool) -> dict[str, Any]:
    """One shared context, one continuation per choice: lm-eval's usual multiple-choice document."""
    choices = _choice_texts(ex)
    if acc_norm and tuple(choices) != ex.choices:
        raise Fp8InputError(f"{ex.id}: acc_norm lengths would differ: choices {ex.choices} vs {choices}")
    return {"id": ex.id, "query": ex.requests[0].context, "choices": choices, "gold": ex.gold}


def _input_row(ex: Example) -> dict[str, Any]:
    """One context per choice and one shared continuation: lm-eval's multiple-input document."""
    continuations = set(_choice_texts(ex))
    if len(continuations) != 1:
        raise Fp8InputError(f"{ex.id}: both contexts and continuations differ between choices")
    return {
        "id": ex.id,
        "contexts": [r.context for r in ex.requests],
        "continuation": continuations.pop(),
        "gold": ex.gold,
    }


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _write_yaml(path: Path, config: dict[str, Any]) -> None:
    """Top-level keys in block style, each value as JSON (a YAML flow value)."""
    lines = [f"{key}: {json.dumps(value, ensure_ascii=False)}" for key, value in config.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _metric(name: str, **options: Any) -> dict[str, Any]:
    return {"metric": name, "aggregation": "mean", "higher_is_better": True, **options}


def _base_config(name: str, jsonl: Path, output_type: str) -> dict[str, Any]:
    """The part every exported task shares: the local JSON lines file as its only (test) split, 0-shot."""
    return {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(jsonl.resolve())}},
        "test_split": "test",
        "output_type": output_type,
        "num_fewshot": 0,
    }


def _examples(task: Task, limit: int | None) -> tuple[Example, ...]:
    if limit is not None and limit < 1:
        raise Fp8InputError(f"limit must be at least 1, got {limit}")
    examples = task.examples[:limit]
    if not examples:
        raise Fp8InputError(f"task {task.name} has no examples to export")
    return examples


def write_lm_eval_task(task: Task, folder: Path, limit: int | None = None) -> str:
    """Write a multiple-choice task's first `limit` examples (all if None) as folder/<name>.jsonl and
    the lm-eval task folder/<name>.yaml (acc, and acc_norm where fp8route reports it); returns <name>,
    to pass as `lm_eval --include_path folder --tasks <name>`."""
    if task.kind != "multiple_choice":
        raise Fp8InputError(f"task {task.name} is {task.kind}, not multiple_choice")
    examples = _examples(task, limit)
    name = lm_eval_name(task)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    jsonl = folder / f"{name}.jsonl"
    config = _base_config(name, jsonl, "multiple_choice")
    if _is_multiple_input(task):
        _write_jsonl(jsonl, (_input_row(ex) for ex in examples))
        config.update(doc_to_text="gold", doc_to_choice="contexts", doc_to_target="continuation")
    else:
        _write_jsonl(jsonl, (_choice_row(ex, task.acc_norm) for ex in examples))
        config.update(doc_to_text="query", doc_to_choice="choices", doc_to_target="gold")
    config["target_delimiter"] = " "
    config["metric_list"] = [_metric("acc")] + ([_metric("acc_norm")] if task.acc_norm else [])
    config["metadata"] = {"version": 1.0, "source": task.source, "prompt": task.prompt}
    _write_yaml(folder / f"{name}.yaml", config)
    return name


def reference_answer(continuation: str) -> str:
    """The number N of a reference chain of thought ending "So the answer is N." (OLMES gsm8k), as the
    dataset's short answer writes it ("- 10" becomes "-10")."""
    match = ANSWER.search(continuation)
    if match is None:
        raise Fp8InputError(f"no 'So the answer is N.' at the end of {continuation[-60:]!r}")
    return match.group(1).replace(" ", "").rstrip(".")


def write_lm_eval_generation_task(
    task: Task, folder: Path, limit: int | None = 8, max_gen_toks: int = 256, suffix: str = "_gen"
) -> str:
    """Write a gsm8k-style generate_until task: each example's context as the prompt, the reference's
    final number as the target (exact_match after lm-eval's gsm8k-cot strict-match filter), greedy,
    stopping at the next "Question:" or a blank line; returns the lm-eval task name."""
    examples = _examples(task, limit)
    name = lm_eval_name(task, suffix)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    jsonl = folder / f"{name}.jsonl"
    rows = [
        {"id": ex.id, "prompt": ex.requests[0].context, "answer": reference_answer(ex.requests[0].continuation)}
        for ex in examples
    ]
    _write_jsonl(jsonl, rows)
    config = _base_config(name, jsonl, "generate_until")
    config.update(doc_to_text="prompt", doc_to_target="answer")
    config["generation_kwargs"] = {"until": STOP, "do_sample": False, "temperature": 0.0, "max_gen_toks": max_gen_toks}
    config["filter_list"] = [
        {
            "name": "strict-match",
            "filter": [{"function": "regex", "regex_pattern": STRICT_MATCH}, {"function": "take_first"}],
        }
    ]
    config["metric_list"] = [
        _metric("exact_match", ignore_case=True, ignore_punctuation=False, regexes_to_ignore=[",", "\\$", "\\.$"])
    ]
    config["metadata"] = {"version": 1.0, "source": task.source, "prompt": task.prompt}
    _write_yaml(folder / f"{name}.yaml", config)
    return name
