"""What clients ask of the engine beyond plain sampling, through LLM on a CPU: logprobs equal the
log-softmax of the engine's own logits; prompt_logprobs equal the full forward's, chunked or not and
with the prefix cache on; n samples share one prefill; structured output; prompt dicts and chat."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from checkpoint_helpers import text_model_folder

from fp8route import LLM, Fp8InputError, SamplingParams
from fp8route.engine.sampler import Sampler
from fp8route.engine.structured import StructuredOutputs

PROMPT = "the quick brown fox jumps over the lazy dog, and the cat sat on the mat by the door"


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


@pytest.fixture(scope="module", params=DEVICES)
def llm(request, tmp_path_factory):
    """On the CPU, and on a GPU (CUDA graphs, the Triton kernels, the sampler on the device)."""
    folder = text_model_folder(tmp_path_factory.mktemp("controls") / "tiny")
    # float32 and a 16-token budget: prompts run in several chunks, and logits compare to 1e-5.
    # num_kv_blocks: the pool is not sized from free memory, which other test processes share on a GPU.
    return LLM(
        folder, max_num_seqs=8, max_num_batched_tokens=16, device=request.param, dtype=torch.float32,
        num_kv_blocks=96,
    )  # fmt: skip


def full_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's full forward (no cache) over ids: [T, vocab], on the CPU."""
    with torch.no_grad():
        return torch.log_softmax(llm.engine.model(torch.tensor([ids], device=llm.engine.device))[0].float(), -1).cpu()


def test_logprobs_are_the_log_softmax_of_the_logits_each_token_was_chosen_from(llm, monkeypatch):
    seen: list[torch.Tensor] = []
    real = Sampler.__call__

    def recording(self, logits, *rest):  # type: ignore[no-untyped-def]
        seen.append(logits.float().clone())
        return real(self, logits, *rest)

    monkeypatch.setattr(Sampler, "__call__", recording)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=4, ignore_eos=True)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    completion = out.outputs[0]
    assert len(seen) == len(completion.token_ids) == len(completion.logprobs) == 6
    for logits, token, entry in zip(seen, completion.token_ids, completion.logprobs, strict=True):
        expected = torch.log_softmax(logits[0].cpu(), -1)
        assert entry[token].logprob == pytest.approx(expected[token].item(), abs=1e-5)
        assert entry[token].rank == int((expected > expected[token]).sum()) + 1
        top = expected.topk(4)
        assert list(entry)[:4] == top.indices.tolist()  # the top 4 by rank, then the token if not among them
        for t, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[t].logprob == pytest.approx(value, abs=1e-5)
        assert entry[token].decoded_token == llm.tokenizer.decode([token])


@pytest.mark.parametrize("padded", [False, True], ids=["rows as they are", "rows padded"])
@pytest.mark.parametrize("budget", [16, 512])
@pytest.mark.parametrize("device", DEVICES)
def test_prompt_logprobs_equal_the_full_forward_chunked_and_after_a_cache_hit(tmp_path, budget, device, padded):
    """padded: lm_head's rows padded to the warmed-up counts, as on a GPU (a CPU can check the slicing)."""
    folder = text_model_folder(tmp_path / "tiny")
    llm = LLM(
        folder, max_num_seqs=4, max_num_batched_tokens=budget, device=device, dtype=torch.float32, num_kv_blocks=64
    )
    llm.engine.runner.pad_lm_head = padded
    ids = llm.encode(PROMPT)
    expected = full_logprobs(llm, ids)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    for _ in range(2):  # the second finds the prompt's blocks cached, and must still score every position
        (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for position in range(1, len(ids)):
            entry = out.prompt_logprobs[position]
            token = ids[position]
            assert entry[token].logprob == pytest.approx(expected[position - 1, token].item(), abs=1e-4)
            best = expected[position - 1].topk(2).indices.tolist()
            assert set(best) <= set(entry)


def test_n_samples_share_one_prefill_and_each_is_the_seeded_single_request(llm):
    ids = llm.encode("a prompt of its own, " * 4)  # several full blocks, none cached before
    stats = llm.engine.blocks.stats
    hits_before = stats.hit_tokens
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    (out,) = llm.generate([ids], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    full_blocks = (len(ids) - 1) // llm.engine.blocks.block_size * llm.engine.blocks.block_size
    assert stats.hit_tokens - hits_before == 3 * full_blocks  # samples 1-3 found the first one's prompt
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        alone = SamplingParams(max_tokens=6, temperature=1.0, seed=11 + c.index, ignore_eos=True)
        (single,) = llm.generate([ids], alone, use_tqdm=False)
        assert single.outputs[0].token_ids == c.token_ids
    assert llm.engine.leaked() is None


def test_an_aborted_group_leaves_nothing_behind(llm):
    engine = llm.engine
    first = engine.add_request(llm.encode(PROMPT), SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.abort(first.group_id)
    engine.drain()
    assert not engine.has_unfinished and engine.leaked() is None and not engine.groups


def test_prompt_dicts_and_chat(llm):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids = llm.encode(PROMPT)
    by_text, by_dict, by_ids = llm.generate([PROMPT, {"prompt": PROMPT}, {"prompt_token_ids": ids}], params)
    assert by_text.token_ids == by_dict.token_ids == by_ids.token_ids and by_dict.prompt == PROMPT
    chat = [{"role": "user", "content": "hello"}]
    (answer,) = llm.chat(chat, params, use_tqdm=False)
    from fp8route.checkpoint.gguf_tokenizer import apply_chat_template

    rendered = apply_chat_template(llm.folder, chat)
    assert answer.prompt_token_ids == llm.encode(rendered)
    with pytest.raises(Fp8InputError, match="a prompt dict holds 'prompt' or 'prompt_token_ids'"):
        llm.generate([{"text": "x"}], params)
    with pytest.raises(Fp8InputError, match="no prompts"):
        llm.generate(None)  # type: ignore[arg-type]


def test_structured_output_holds_every_sample_to_its_schema(llm):
    pytest.importorskip("xgrammar")
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["color", "n"],
    }
    params = SamplingParams(
        n=4, max_tokens=40, temperature=1.0, seed=5, structured_outputs=StructuredOutputs(json=json.dumps(schema))
    )
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    for completion in out.outputs:
        value = json.loads(completion.text)
        assert value["color"] in ("red", "green") and 0 <= value["n"] <= 9, completion.text
        assert completion.finish_reason == "stop"
    choice = SamplingParams(max_tokens=10, temperature=1.0, structured_outputs=StructuredOutputs(choice=("yes", "no")))
    assert {o.text for o in llm.generate([PROMPT] * 6, choice, use_tqdm=False)} <= {"yes", "no"}
    with pytest.raises(Fp8InputError, match="cannot compile the regex"):
        llm.generate([PROMPT], SamplingParams(structured_outputs=StructuredOutputs(regex="(ab")))


def test_structured_output_under_async_scheduling_when_requests_end_mid_step(tmp_path):
    """With async scheduling the step in flight is read back while the next one's masks are made: a
    request it ends gives its row up before that step samples; one that ignores EOS past the end of its
    grammar gets EOS only."""
    pytest.importorskip("xgrammar")
    folder = text_model_folder(tmp_path / "tiny")
    llm = LLM(folder, max_num_seqs=8, max_num_batched_tokens=32, device="cpu", dtype=torch.float32,
              async_scheduling=True, num_kv_blocks=64)  # fmt: skip
    choice = StructuredOutputs(choice=("yes", "no"))
    cut = SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=1, structured_outputs=choice)
    past = SamplingParams(max_tokens=8, temperature=1.0, seed=2, ignore_eos=True, structured_outputs=choice)
    short, long = llm.generate([PROMPT, PROMPT + " again"], [cut, past], use_tqdm=False)
    assert all(c.text in ("y", "n", "ye", "yes", "no") for c in short.outputs), [c.text for c in short.outputs]
    (ids,) = [c.token_ids for c in long.outputs]
    assert long.outputs[0].text in ("yes", "no") and len(ids) == 8
    eos = set(llm.engine.eos_token_ids)
    text_tokens = len(llm.encode(long.outputs[0].text))
    assert set(ids[text_tokens:]) <= eos  # after the grammar's end: EOS only
    assert llm.engine.leaked() is None


def spanning_stop(llm: LLM, token_ids: list[int], text: str) -> str:
    """Three characters of text that start inside its third token and end past it: a stop string that
    no one token holds, found only where the tokens' text is joined."""
    end = len(llm.tokenizer.decode(token_ids[:3]))
    assert end > 1 and end + 2 <= len(text), text
    return text[end - 1 : end + 2]


def test_a_stop_string_ends_the_text_before_it_wherever_tokens_split_it(llm):
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    (whole,) = llm.generate([PROMPT], free, use_tqdm=False)
    text, ids = whole.outputs[0].text, whole.outputs[0].token_ids
    stop = spanning_stop(llm, ids, text)
    (cut,) = llm.generate([PROMPT], replace(free, stop=["\x00never", stop]), use_tqdm=False)
    out = cut.outputs[0]
    assert out.text == text[: text.index(stop)] and (out.finish_reason, out.stop_reason) == ("stop", stop)
    # Its tokens end with the one that completed the stop string: the sample was stopped there.
    assert out.token_ids == ids[: len(out.token_ids)] and len(out.token_ids) < len(ids)
    assert stop in llm.tokenizer.decode(out.token_ids) and stop not in llm.tokenizer.decode(out.token_ids[:-1])
    assert llm.engine.leaked() is None and not llm.engine.groups


def test_each_sample_stops_at_its_own_stop_string_and_the_rest_run_on(llm):
    free = SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=9, ignore_eos=True)
    (whole,) = llm.generate([PROMPT], free, use_tqdm=False)
    first = whole.outputs[0]
    stop = spanning_stop(llm, first.token_ids, first.text)
    (cut,) = llm.generate([PROMPT], replace(free, stop=stop), use_tqdm=False)
    assert cut.outputs[0].text == first.text[: first.text.index(stop)]
    for out in cut.outputs:
        decoded = llm.tokenizer.decode(out.token_ids)
        if out.finish_reason == "stop":
            assert out.stop_reason == stop and decoded.startswith(out.text + stop), (out.text, decoded)
            assert stop not in llm.tokenizer.decode(out.token_ids[:-1])
        else:  # its text never held the stop string: it ran to max_tokens
            assert (out.finish_reason, len(out.token_ids)) == ("length", 16) and stop not in decoded
    assert llm.engine.leaked() is None and not llm.engine.groups


def test_stop_strings_need_the_tokenizer_and_are_strings(llm, monkeypatch):
    with pytest.raises(Fp8InputError, match="stop holds an empty string, which would match everywhere"):
        SamplingParams(stop=["x", ""])
    with pytest.raises(Fp8InputError, match="stop must be a string or a list of strings, got 5"):
        SamplingParams(stop=5)  # type: ignore[arg-type]
    assert SamplingParams(stop="x").stop == ("x",)
    ids = llm.encode(PROMPT)
    monkeypatch.setattr(llm, "tokenizer", None)
    with pytest.raises(Fp8InputError, match="prompt 0: stop strings are matched on the text, which needs the token"):
        llm.generate([ids], SamplingParams(stop="x"), use_tqdm=False)


def test_cumulative_logprob_sums_the_sampled_tokens_logprobs_when_asked_for(llm):
    asked = SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=4, logprobs=0, ignore_eos=True)
    (out,) = llm.generate([PROMPT], asked, use_tqdm=False)
    for c in out.outputs:
        own = [entry[token].logprob for entry, token in zip(c.logprobs, c.token_ids, strict=True)]
        assert len(own) == 5 and c.cumulative_logprob == pytest.approx(sum(own), abs=1e-9)
        assert c.cumulative_logprob < 0
    (plain,) = llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None  # as vLLM
