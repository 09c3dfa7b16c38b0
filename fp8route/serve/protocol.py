"""OpenAI's request and response shapes as pydantic models, as vLLM's entrypoints/openai/protocol.py
mirrors them, with every check a request can fail before it reaches the engine.

Requests are validated strictly ("5" is not an integer, an unknown field is an error), and every
OpenAI parameter this server does not implement is refused by name unless it holds the value that
changes nothing (n=1, logprobs=false, ...): a client must never get silently different output.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fp8route.engine.sampling import SamplingParams


class InvalidParam(ValueError):
    """A request field that fails a check of ours; the server's 400 names `param`."""

    def __init__(self, param: str | None, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# OpenAI (and vLLM extension) parameters with no implementation here: (the values that change nothing, why).
UNSUPPORTED: dict[str, tuple[tuple[object, ...], str]] = {
    "n": ((1,), "one choice per request"),
    "best_of": ((1,), "one choice per request"),
    "logprobs": ((False,), "log probabilities are not returned"),
    "top_logprobs": ((0,), "log probabilities are not returned"),
    "prompt_logprobs": ((0,), "log probabilities are not returned"),
    "echo": ((False,), "the prompt is not echoed back"),
    "suffix": (("",), "no text is inserted before a suffix"),
    "presence_penalty": ((0, 0.0), "no penalties are applied"),
    "frequency_penalty": ((0, 0.0), "no penalties are applied"),
    "repetition_penalty": ((1, 1.0), "no penalties are applied"),
    "logit_bias": (({},), "logits are not biased"),
    "top_k": ((-1, 0), "sampling is temperature and top_p only"),
    "min_p": ((0, 0.0), "sampling is temperature and top_p only"),
    "tools": (([],), "no tool calls"),
    "tool_choice": (("none",), "no tool calls"),
    "functions": (([],), "no tool calls"),
    "function_call": (("none",), "no tool calls"),
    "parallel_tool_calls": ((), "no tool calls"),
    "response_format": (({"type": "text"},), "no structured output"),
}


def _changes_nothing(value: object, neutral: tuple[object, ...]) -> bool:
    return value is None or any(type(value) is type(v) and value == v for v in neutral)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class _Generation(_Strict):
    """What completions and chat completions share: the model, sampling, stopping and streaming."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []  # vLLM's extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension, which serving benchmarks send
    min_tokens: int = Field(0, ge=0)  # vLLM's extension
    user: str | None = None  # the caller's own label for its end user; it changes no output

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name, (neutral, why) in UNSUPPORTED.items():
            if name in data and not _changes_nothing(value := data.pop(name), neutral):
                fix = f"leave it out or set it to {json.dumps(neutral[0])}" if neutral else "leave it out"
                raise InvalidParam(
                    name, f"'{name}'={short(value)} is not supported ({why}); {fix}", "unsupported_parameter"
                )
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise InvalidParam("stop", f"'stop' must be a string or a list of strings, got {short(value)}")
        if "" in value:
            raise InvalidParam("stop", "'stop' holds an empty string, which would match everywhere; remove it")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _ids_not_negative(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise InvalidParam("stop_token_ids", f"'stop_token_ids' must be token ids >= 0, got {short(value)}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> _Generation:
        if self.stream_options is not None and not self.stream:
            raise InvalidParam("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParam(
                "min_tokens", f"'min_tokens' ({self.min_tokens}) must not exceed 'max_tokens' ({self.max_tokens})"
            )
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
        )


class CompletionRequest(_Generation):
    prompt: str | list[int]  # one prompt: text, or token ids
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]  # a batch of one
        if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
            raise InvalidParam("prompt", f"'prompt' is a list of {len(value)} prompts; send one prompt per request")
        if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            if not value:
                raise InvalidParam("prompt", "'prompt' is empty: give some text or at least one token id")
            return value
        if isinstance(value, str):
            if not value:
                raise InvalidParam("prompt", "'prompt' is empty: give some text or at least one token id")
            return value
        raise InvalidParam("prompt", f"'prompt' must be a string or a list of token ids, got {short(value)}")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, list):  # OpenAI's content parts: only text ones can be rendered here
            kinds = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in value]
            if any(k != "text" for k in kinds):
                other = next(k for k in kinds if k != "text")
                raise InvalidParam("messages", f"only text content parts are supported, got one of type {short(other)}")
            return "".join(TextPart.model_validate(p).text for p in value)
        return value


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise InvalidParam("messages", "'messages' is empty: give at least one message")
        return value

    @model_validator(mode="after")
    def _one_limit(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise InvalidParam("max_completion_tokens", "give 'max_tokens' or 'max_completion_tokens', not both")
            self.max_tokens = self.max_completion_tokens
            if self.min_tokens > self.max_tokens:
                raise InvalidParam(
                    "min_tokens", f"'min_tokens' ({self.min_tokens}) must not exceed 'max_tokens' ({self.max_tokens})"
                )
        return self


# Responses: OpenAI's fields, plus vLLM's stop_reason (the stop string or token id that ended a choice).


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fp8route"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
