"""The request models alone: what serving benchmarks and clients send at neutral values is accepted,
and each refusal names its parameter in one sentence."""

import pytest
import serve_helpers  # noqa: F401  (the serve extra, or the skip / CI failure)
from pydantic import ValidationError

from fp8route.serve.errors import from_validation
from fp8route.serve.protocol import ChatCompletionRequest, CompletionRequest, InvalidParam


def refusal(model, body):
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return from_validation(caught.value)


def test_what_vllms_serving_benchmark_sends_is_accepted():
    body = {
        "model": "m", "prompt": "hi", "temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 8,
        "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    request = CompletionRequest.model_validate(body)
    params = request.sampling_params()
    assert (params.max_tokens, params.temperature, params.ignore_eos) == (8, 0.0, True)
    assert request.include_usage and not request.continuous_usage
    assert params.stop == ()
    stop = CompletionRequest.model_validate({**body, "stop": "\n\n"}).sampling_params().stop
    assert stop == ("\n\n",)  # the server's stop strings are SamplingParams', as LLM.generate's


def test_max_tokens_left_out_is_fitted_to_the_context_and_one_sent_is_kept():
    request = CompletionRequest.model_validate({"model": "m", "prompt": "hi"})
    assert request.sampling_params().max_tokens == 16  # OpenAI's default for completions
    assert request.sampling_params(10, 256).max_tokens == 16
    assert request.sampling_params(250, 256).max_tokens == 6  # not a 16 the client never sent, refused
    sent = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "max_tokens": 100})
    assert sent.sampling_params(250, 256).max_tokens == 100  # the engine refuses what the client asked
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert chat.sampling_params(250, 256).max_tokens is None
    with pytest.raises(InvalidParam, match="prompt's 256 tokens fill the model's context of 256 tokens"):
        request.sampling_params(256, 256)


def test_unimplemented_parameters_at_their_neutral_values_change_nothing_and_are_accepted():
    neutral = {"n": 1, "best_of": 1, "echo": False, "presence_penalty": 0, "frequency_penalty": 0.0, "top_k": -1,
               "min_p": 0.0, "logit_bias": {}, "suffix": None, "user": "someone"}  # fmt: skip
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2], **neutral}).prompt == [1, 2]
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "logprobs": False, "top_logprobs": 0}  # fmt: skip
    assert ChatCompletionRequest.model_validate(chat).max_tokens is None  # chat: until the context is full


def test_a_value_that_would_change_the_output_is_refused_by_name():
    error = refusal(CompletionRequest, {"model": "m", "prompt": "x", "suffix": "end"})
    assert (error.status, error.param, error.code) == (400, "suffix", "unsupported_parameter")
    assert (
        error.message
        == "'suffix'='end' is not supported (no text is inserted before a suffix); leave it out or set it to \"\""
    )
    assert refusal(CompletionRequest, {"model": "m", "prompt": "x", "best_of": 2}).param == "best_of"
    assert refusal(CompletionRequest, {"model": "m", "prompt": "x", "n": True}).param == "n"  # True is not 1 here


def test_sampling_controls_reach_the_sampling_params():
    body = {
        "model": "m", "prompt": "x", "n": 3, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2,
        "frequency_penalty": 0.5, "presence_penalty": -0.5, "logit_bias": {"7": 2.5}, "logprobs": 2, "echo": True,
        "seed": 4,
    }  # fmt: skip
    p = CompletionRequest.model_validate(body).sampling_params()
    assert (p.n, p.top_k, p.min_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (
        3, 5, 0.1, 1.2, 0.5, -0.5,
    )  # fmt: skip
    assert p.logit_bias == {7: 2.5} and (p.logprobs, p.prompt_logprobs, p.seed) == (2, 2, 4)
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3}
    assert ChatCompletionRequest.model_validate(chat).sampling_params().logprobs == 3
    assert refusal(CompletionRequest, {**body, "logit_bias": {"a": 1}}).param == "logit_bias"


def test_structured_output_fields_become_one_spec():
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    spec = ChatCompletionRequest.model_validate({**chat, "response_format": fmt}).structured_outputs()
    assert spec is not None and spec.json is not None and '"a"' in spec.json
    spec = ChatCompletionRequest.model_validate({**chat, "response_format": {"type": "json_object"}})
    assert spec.structured_outputs().json_object
    assert CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "guided_choice": ["a", "b"]}
    ).structured_outputs().choice == ("a", "b")
    from fp8route.serve.protocol import InvalidParam

    with pytest.raises(InvalidParam, match="give one kind of structured output, got guided_regex and response_format"):
        ChatCompletionRequest.model_validate(
            {**chat, "guided_regex": "a+", "response_format": {"type": "json_object"}}
        ).structured_outputs()


def test_chat_text_parts_are_joined_and_max_completion_tokens_is_max_tokens():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": parts}], "max_completion_tokens": 5}
    )
    assert request.messages[0].content == "ab" and request.sampling_params().max_tokens == 5
    both = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "max_completion_tokens": 5}
    assert "not both" in refusal(ChatCompletionRequest, both).message


def test_a_batch_of_one_prompt_is_that_prompt():
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["hi"]}).prompt == "hi"
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[3, 4]]}).prompt == [3, 4]
    assert refusal(CompletionRequest, {"model": "m", "prompt": [True, 2]}).param == "prompt"


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_chunks_from_the_template_equal_the_models(chat: bool) -> None:
    """Middle pieces are a template filled in with the text: each must parse to what the pydantic
    chunk gives, for texts JSON has to escape."""
    import json

    from fp8route.engine.sampling import SamplingParams
    from fp8route.serve.responses import Formats, sse
    from fp8route.serve.serving import Job, Piece

    job = Job("cmpl-7", [1, 2], SamplingParams())
    formats, reference = Formats(job, 'm "x"', chat, False, str), Formats(job, 'm "x"', chat, False, str)
    texts = ["hi", 'a "quote" and \\ slash', "new\nline\ttab", "ünïcødé 中文 🙂", "\x01\x1f ctrl", ""]
    texts.append("@@fp8route-text@@")
    for i, text in enumerate(texts):
        piece = Piece(text, 2, i)
        event, expected = formats.event(piece), sse(reference.chunk(piece))
        assert event.startswith("data: ") and event.endswith("\n\n")
        assert json.loads(event[6:]) == json.loads(expected[6:]), text
    last = Piece("end", 2, 9, finish_reason="length")
    assert json.loads(formats.event(last)[6:])["choices"][0]["finish_reason"] == "length"
