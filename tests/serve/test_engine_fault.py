"""An exception inside the engine fails the requests it touched with a 500 naming it (or, once a stream
has started, an error event in it) and the server goes on serving. Uvicorn runs in this process here,
on a thread, so that a step can be made to fail."""

import threading
import time

import pytest
from serve_helpers import metrics, request

from fp8route import LLM
from fp8route.engine.async_llm import AsyncLLM

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

FAIL_AT_ONCE, FAIL_LATER = 7, 9  # a prompt's first token id: when a step that runs it raises


@pytest.fixture
def faulty(tiny_folder):
    from fp8route.serve.app import build_app
    from fp8route.serve.serving import Serving

    llm = LLM(tiny_folder, max_num_seqs=4, max_num_batched_tokens=64, device="cpu")
    real = llm.engine.runner.forward

    def forward(out, *rest):
        for r in (llm.engine.requests[piece.request_id] for piece in out.seqs):
            first = r.prompt_token_ids[0]
            if first == FAIL_AT_ONCE or (first == FAIL_LATER and r.num_output_tokens >= 3):
                raise RuntimeError("injected kernel failure")
        return real(out, *rest)

    llm.engine.runner.forward = forward
    engine = AsyncLLM(llm)
    serving = Serving(engine, "tiny", tiny_folder, max_num_seqs=4, max_queue=8)
    app = build_app(serving, api_key=None, max_request_bytes=1 << 20)
    server = uvicorn.Server(uvicorn.Config(app, port=0, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(30)
    engine.shutdown()


def test_an_engine_failure_is_a_500_naming_it_and_the_server_goes_on(faulty):
    client = openai.OpenAI(base_url=faulty + "/v1", api_key="unused", max_retries=0, timeout=120)
    for stream in (False, True):  # the first step fails: a streamed answer has not started, so it is a 500 too
        with pytest.raises(openai.InternalServerError, match="RuntimeError: injected kernel failure") as caught:
            out = client.completions.create(model="tiny", prompt=[FAIL_AT_ONCE, 5, 6], max_tokens=8, stream=stream)
            list(out) if stream else out
        assert caught.value.body["code"] == "engine_error" and caught.value.body["type"] == "server_error"
    chunks = []
    with pytest.raises(openai.APIError, match="RuntimeError: injected kernel failure"):
        for chunk in client.completions.create(
            model="tiny", prompt=[FAIL_LATER, 5, 6], max_tokens=20, stream=True, extra_body={"ignore_eos": True}
        ):
            chunks.append(chunk)
    assert len(chunks) == 3  # the tokens before the failing step came through
    fine = client.completions.create(model="tiny", prompt=[5, 6], max_tokens=4, extra_body={"ignore_eos": True})
    assert fine.usage.completion_tokens == 4
    assert request(faulty + "/health") == (200, {"status": "ok"})
    after = metrics(faulty)
    assert after["fp8route:request_failed_total"] == 3 and after["fp8route:kv_cache_used_blocks"] == 0
