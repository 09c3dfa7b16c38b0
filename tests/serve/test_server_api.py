"""The real server, driven by the official openai client: completions and chat, streamed and not,
stop strings, usage; every bad input a 4xx in OpenAI's error body with one sentence naming it, and
the server still serving after; 401 without the key."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_helpers import API_KEY, MODEL, metrics, request

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def offline_tokens(client, prompt, n):
    """The greedy continuation's text, one request: what streamed answers must add up to."""
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def test_models_lists_the_served_name_and_its_context(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 256


def test_a_completion_from_text_and_from_token_ids(client, tiny_folder):
    from fp8route.models.tokenizer import load_tokenizer

    ids = load_tokenizer(tiny_folder).encode("the cat sat", add_special_tokens=False).ids
    by_text = client.completions.create(
        model=MODEL, prompt="the cat sat", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    by_ids = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.choices[0].finish_reason == "length"
    usage = by_text.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), 6, len(ids) + 6)
    assert by_text.object == "text_completion" and by_text.model == MODEL and by_text.id.startswith("cmpl-")


def test_a_streamed_completion_adds_up_to_the_whole_one_and_ends_with_usage(client):
    whole = offline_tokens(client, "once upon a time", 12)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="once upon a time", max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole
    assert len(texts) == 12  # one chunk per step, each with its token (text may wait for a whole character)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streamed_and_not_agree_and_use_the_chat_template(client, tiny_folder):
    from fp8route.checkpoint.gguf_tokenizer import apply_chat_template
    from fp8route.models.tokenizer import load_tokenizer

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    kwargs = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 10,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**kwargs)
    rendered = apply_chat_template(tiny_folder, messages)
    assert whole.usage.prompt_tokens == len(load_tokenizer(tiny_folder).encode(rendered, add_special_tokens=False).ids)
    assert whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 10
    # the same prompt through /v1/completions gives the same text: chat is the template, then the engine
    assert offline_tokens(client, rendered, 10) == whole.choices[0].message.content


def test_a_stop_string_ends_the_text_before_it_streamed_or_not(client):
    text = offline_tokens(client, "stop here", 30)
    stop = text[5:8]
    assert len(stop) == 3 and stop not in text[:5]
    before = text[: text.index(stop)]
    whole = client.completions.create(
        model=MODEL, prompt="stop here", max_tokens=30, temperature=0, stop=[stop, "\x00never"]
    )
    assert whole.choices[0].text == before
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].model_extra["stop_reason"] == stop
    assert whole.usage.completion_tokens < 30  # the request was aborted at the stop string
    chunks = list(
        client.completions.create(model=MODEL, prompt="stop here", max_tokens=30, temperature=0, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == before
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats_and_params_reach_the_engine(client):
    kwargs = {"model": MODEL, "prompt": "seeded", "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    sampled = {"temperature": 1.0, "top_p": 0.9}
    first, second = (client.completions.create(**kwargs, **sampled, seed=7).choices[0].text for _ in range(2))
    other = client.completions.create(**kwargs, **sampled, seed=8).choices[0].text
    greedy = client.completions.create(**kwargs, temperature=0).choices[0].text
    # Greedy repeats too: the sample must also differ from it, and from another seed's, or the
    # temperature and the seed never reached the sampler.
    assert first == second and first != greedy and other not in (first, greedy)
    stopped = client.completions.create(
        model=MODEL, prompt="seeded", max_tokens=12, temperature=0, extra_body={"min_tokens": 12, "stop_token_ids": [2]}
    )
    assert stopped.usage.completion_tokens == 12  # min_tokens holds EOS and stop ids back


X = {"model": MODEL, "prompt": "x"}  # a good completion body, for one field to spoil
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
BAD = [
    # (what, path, body, status, words the message must hold, param)
    ("malformed JSON", "completions", b'{"model": "tiny", "prompt": ', 400, "not valid JSON", None),
    ("not an object", "completions", b"[1, 2]", 400, "must be a JSON object", None),
    ("missing prompt", "completions", {"model": MODEL}, 400, "'prompt' is required", "prompt"),
    ("missing messages", "chat/completions", {"model": MODEL}, 400, "'messages' is required", "messages"),
    ("missing model", "completions", {"prompt": "x"}, 400, "'model' is required", "model"),
    ("wrong type", "completions", {**X, "max_tokens": "ten"}, 400, "valid integer, got 'ten'", "max_tokens"),
    ("wrong type bool", "completions", {**X, "stream": "yes"}, 400, "valid boolean", "stream"),
    ("unknown model", "completions", {**X, "model": "gpt-4"}, 404, "'gpt-4' does not exist", "model"),
    ("max_tokens 0", "completions", {**X, "max_tokens": 0}, 400, "greater than or equal to 1", "max_tokens"),
    ("over the context", "completions", {**X, "prompt": "x" * 200, "max_tokens": 100}, 400, "context of 256", None),
    ("a prompt filling the context", "completions", {**X, "prompt": [5] * 256}, 400, "leave none to generate",
     "prompt"),
    ("temperature", "completions", {**X, "temperature": 2.5}, 400, "temperature must be a number in [0, 2], got 2.5",
     "temperature"),
    ("temperature NaN", "completions", {**X, "temperature": float("nan")}, 400, "got NaN (not a number)",
     "temperature"),
    ("top_p", "chat/completions", {**CHAT, "top_p": 1.5}, 400, "top_p must be a number in (0, 1], got 1.5", "top_p"),
    ("top_p 0", "completions", {**X, "top_p": 0}, 400, "top_p must be a number in (0, 1], got 0", "top_p"),
    ("a penalty", "completions", {**X, "presence_penalty": -3.0}, 400, "in [-2, 2], got -3.0", "presence_penalty"),
    ("empty prompt", "completions", {**X, "prompt": ""}, 400, "'prompt' is empty", "prompt"),
    ("empty ids", "completions", {**X, "prompt": []}, 400, "'prompt' is empty", "prompt"),
    ("empty messages", "chat/completions", {**CHAT, "messages": []}, 400, "'messages' is empty", "messages"),
    ("ids outside the vocabulary", "completions", {**X, "prompt": [5, 262]}, 400, "0..261 (the vocabulary)", None),
    ("negative id", "completions", {**X, "prompt": [-1]}, 400, "got -1", None),
    ("several prompts streamed", "completions", {**X, "prompt": ["a", "b"], "stream": True}, 400,
     "'prompt' holds 2 prompts and a stream answers one", "prompt"),
    ("an empty prompt in a batch", "completions", {**X, "prompt": ["a", ""]}, 400, "'prompt[1]' is empty", "prompt"),
    ("n over 128", "completions", {**X, "n": 129}, 400, "less than or equal to 128", "n"),
    ("logprobs over 20", "completions", {**X, "logprobs": 21}, 400, "less than or equal to 20", "logprobs"),
    ("top_logprobs alone", "chat/completions", {**CHAT, "top_logprobs": 2}, 400, "needs 'logprobs': true",
     "top_logprobs"),
    ("logit_bias past the vocabulary", "completions", {**X, "logit_bias": {"999": 1}}, 400, "past the vocabulary",
     None),
    ("logit_bias not an id", "completions", {**X, "logit_bias": {"the": 1}}, 400, "keys are token ids",
     "logit_bias"),
    ("a regex that does not compile", "completions", {**X, "guided_regex": "(ab"}, 400,
     "cannot compile the regex", None),
    ("a schema that is not one", "chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 5}}}},
     400, "cannot compile the JSON schema", None),
    ("two structured outputs", "chat/completions",
     {**CHAT, "guided_regex": "a", "response_format": {"type": "json_object"}}, 400,
     "one kind of structured output", None),
    ("best_of", "completions", {**X, "best_of": 3}, 400, "'best_of'=3 is not supported", "best_of"),
    ("tools", "chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "(no tool calls)", "tools"),
    ("unknown field", "completions", {**X, "frobnicate": 1}, 400, "unrecognized request argument 'frobnicate'",
     "frobnicate"),
    ("a tool role", "chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400,
     "'messages[0].role'", "messages"),
    ("an image part", "chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "only text content parts", "messages"),
    ("min over max", "completions", {**X, "max_tokens": 2, "min_tokens": 3}, 400, "must not exceed 'max_tokens' (2)",
     "min_tokens"),
    ("empty stop", "completions", {**X, "stop": [""]}, 400, "empty string", "stop"),
    ("stream_options alone", "completions", {**X, "stream_options": {"include_usage": True}}, 400,
     "only allowed when 'stream' is true", "stream_options"),
    ("over the size limit", "completions", {**X, "prompt": "x" * 70000}, 413, "server's limit of 65536", None),
]  # fmt: skip


@pytest.mark.parametrize("what, path, body, status, words, param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_in_openais_error_body(server, what, path, body, status, words, param):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    got, answer = request(f"{server.url}/v1/{path}", body, headers)
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error["message"]
    assert "\n" not in error["message"] and "Traceback" not in error["message"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_a_completion_without_max_tokens_takes_what_its_context_leaves(client):
    # OpenAI's default of 16 would pass the context of 256: it is the default, not a value to refuse.
    out = client.completions.create(model=MODEL, prompt=[5] * 250, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"


def test_after_every_bad_input_the_server_is_healthy_and_serves(server, client):
    assert request(server.url + "/health") == (200, {"status": "ok"})
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=3).usage.completion_tokens >= 1
    counts = metrics(server.url)
    assert counts['fp8route:request_rejected_total{status="400"}'] >= 25
    assert counts["fp8route:kv_cache_used_blocks"] == 0 and counts["fp8route:num_requests_in_flight"] == 0


def test_greedy_streams_decoding_together_launch_steps_ahead(server, client):
    before = metrics(server.url)["fp8route:steps_launched_ahead_total"]

    def one(i: int) -> int:
        out = client.completions.create(model=MODEL, prompt=f"count {i}", max_tokens=12, temperature=0)
        return out.usage.completion_tokens

    with ThreadPoolExecutor(4) as pool:
        assert all(n >= 1 for n in pool.map(one, range(4)))
    assert metrics(server.url)["fp8route:steps_launched_ahead_total"] > before  # the server runs --async-scheduling on


def test_without_the_key_v1_is_401_and_health_and_metrics_are_open(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, answer = request(server.url + "/v1/models", headers=headers)
        assert status == 401, answer
        assert answer["error"]["code"] == "invalid_api_key" and "Authorization: Bearer" in answer["error"]["message"]
    with pytest.raises(openai.AuthenticationError, match="missing or wrong API key"):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert request(server.url + "/health")[0] == 200
    assert request(server.url + "/metrics")[0] == 200


def test_an_unknown_route_is_a_404_in_the_error_body(server):
    status, answer = request(server.url + "/v2/completions", {"x": 1}, {"Authorization": f"Bearer {API_KEY}"})
    assert status == 404 and "the API is under /v1" in answer["error"]["message"]


def test_the_engine_runs_in_a_process_of_its_own(server):
    """The server's process holds HTTP and the streams; the model and its steps live in one child
    (beside multiprocessing's resource tracker), whose memory /metrics reports."""
    from pathlib import Path

    proc = Path("/proc")
    if not (proc / str(server.proc.pid)).is_dir():
        pytest.skip("needs /proc (Linux)")

    def rss(pid: str) -> int:
        import os

        return int((proc / pid / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    children = [p.name for p in proc.iterdir() if p.name.isdigit() and _parent(p) == server.proc.pid]
    engines = [pid for pid in children if _spawned_engine(proc / pid)]
    assert len(engines) == 1, children
    values = metrics(server.url)
    assert abs(values["fp8route:engine_resident_memory_bytes"] - rss(engines[0])) < 64 << 20


def _parent(pid_dir) -> int:  # type: ignore[no-untyped-def]
    try:
        return int((pid_dir / "stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _spawned_engine(pid_dir) -> bool:  # type: ignore[no-untyped-def]
    """multiprocessing's spawned child (not its resource tracker)."""
    cmdline = (pid_dir / "cmdline").read_bytes().decode(errors="replace")
    return "spawn_main" in cmdline and "resource_tracker" not in cmdline
