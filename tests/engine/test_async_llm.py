"""AsyncLLM: streams equal the offline LLM's outputs, an abandoned stream aborts its request and
frees its blocks, a bad request is refused before it is queued, and a failing step fails only the
requests it ran."""

import asyncio

import pytest
import torch
from checkpoint_helpers import text_model_folder

from fp8route import LLM, Fp8InputError, SamplingParams
from fp8route.engine.async_llm import AsyncLLM, EngineError


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = text_model_folder(tmp_path_factory.mktemp("text") / "tiny")
    # float32: the streams are batched otherwise than the offline run, and bfloat16 logits have near-ties
    return LLM(folder, max_num_seqs=4, max_num_batched_tokens=32, device="cpu", dtype=torch.float32)


def collect(engine: AsyncLLM, ids, params):
    async def run():
        return [out async for out in engine.generate(ids, params)]

    return asyncio.run(run())


def test_streams_equal_the_offline_outputs_and_the_pool_drains(llm):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = ["the cat", "hello there, the world", "x"]
    offline = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = AsyncLLM(llm)
    try:

        async def all_at_once():
            async def one_stream(text):
                outs = [out async for out in engine.generate(llm.encode(text), params)]
                assert outs[-1].finished and outs[-1].finish_reason == "length"
                return [t for out in outs for t in out.new_token_ids]

            return await asyncio.gather(*(one_stream(p) for p in prompts))

        assert asyncio.run(all_at_once()) == offline
        assert engine.snapshot().generation_tokens == 24
        assert engine.snapshot().kv_used_blocks == 0
    finally:
        engine.shutdown()


def test_an_abandoned_stream_aborts_its_request(llm):
    engine = AsyncLLM(llm)
    try:

        async def leave_early():
            stream = engine.generate(llm.encode("the cat sat"), SamplingParams(max_tokens=100, ignore_eos=True))
            async for out in stream:
                if out.new_token_ids:
                    break
            await stream.aclose()
            for _ in range(200):
                if engine.idle and engine.snapshot().kv_used_blocks == 0:
                    return True
                await asyncio.sleep(0.01)
            return False

        assert asyncio.run(leave_early())
        assert llm.engine.leaked() is None
    finally:
        engine.shutdown()


def test_a_request_that_cannot_run_is_refused_before_it_is_queued(llm):
    engine = AsyncLLM(llm)
    try:
        with pytest.raises(Fp8InputError, match="exceeds the model's context"):
            collect(engine, [5] * 250, SamplingParams(max_tokens=10))
        assert engine.idle
    finally:
        engine.shutdown()


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(llm, monkeypatch):
    engine = AsyncLLM(llm)
    real = llm.engine.runner.forward
    calls = []

    def broken(out, *rest):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a kernel failed")
        return real(out, *rest)

    monkeypatch.setattr(llm.engine.runner, "forward", broken)
    try:
        with pytest.raises(EngineError, match="RuntimeError: a kernel failed"):
            collect(engine, llm.encode("the"), SamplingParams(max_tokens=4))
        outs = collect(engine, llm.encode("the"), SamplingParams(max_tokens=4, ignore_eos=True))
        assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 4
        assert llm.engine.leaked() is None
    finally:
        engine.shutdown()
