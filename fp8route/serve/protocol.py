"""OpenAI's request and response shapes as pydantic models, as vLLM's entrypoints/openai/protocol.py
mirrors them, with every check a request can fail before it reaches the engine.

Requests are validated strictly ("5" is not an integer, an unknown field is an error), and every
OpenAI parameter this server does not implement is refused by name unless it holds the value that
changes nothing (no tools, no suffix): a client must never get silently different output.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from fp8route.engine.sampling import MAX_LOGPROBS, RANGES, SamplingParams, stop_strings
from fp8route.engine.structured import StructuredOutputs
from fp8route.errors import Fp8InputError


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
    "best_of": ((1,), "one draw per sample; ask for n samples instead"),
    "suffix": (("",), "no text is inserted before a suffix"),
    "tools": (([],), "no tool calls"),
    "tool_choice": (("none",), "no tool calls"),
    "functions": (([],), "no tool calls"),
    "function_call": (("none",), "no tool calls"),
    "parallel_tool_calls": ((), "no tool calls"),
}


def _changes_nothing(value: object, neutral: tuple[object, ...]) -> bool:
    return value is None or any(type(value) is type(v) and value == v for v in neutral)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class JsonSchema(_Strict):
    name: str = "schema"
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class _Generation(_Strict):
    """What completions and chat completions share: the model, sampling, stopping, structured output
    and streaming."""

    model: str
    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None  # these floats' ranges: fp8route.engine.sampling.RANGES
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension, as the rest of this block
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None  # vLLM's structured-output extensions
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
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

    @field_validator(*RANGES)
    @classmethod
    def _in_range(cls, value: float | None, info: ValidationInfo) -> float | None:
        name = str(info.field_name)
        why = None if value is None else RANGES[name].why_not(name, value)
        if why is not None:
            raise InvalidParam(name, why)
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        try:
            return list(stop_strings(value))
        except Fp8InputError as exc:
            raise InvalidParam("stop", str(exc)) from None

    @field_validator("stop_token_ids")
    @classmethod
    def _ids_not_negative(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise InvalidParam("stop_token_ids", f"'stop_token_ids' must be token ids >= 0, got {short(value)}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:  # the values' range is SamplingParams' check
            if not key.isdigit():
                raise InvalidParam("logit_bias", f"'logit_bias' keys are token ids (as strings), got {short(key)}")
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

    def structured_outputs(self) -> StructuredOutputs | None:
        """What the output must match: response_format or one of vLLM's guided_* fields."""
        fmt = self.response_format if self.response_format is not None and self.response_format.type != "text" else None
        given = (
            ("guided_json", self.guided_json), ("guided_regex", self.guided_regex),
            ("guided_choice", self.guided_choice), ("response_format", fmt),
        )  # fmt: skip
        asked = [name for name, value in given if value is not None]
        if len(asked) > 1:
            raise InvalidParam(None, f"give one kind of structured output, got {' and '.join(asked)}")
        if not asked:
            return None
        try:
            if self.guided_json is not None:
                return StructuredOutputs(json=self.guided_json)
            if self.guided_regex is not None:
                return StructuredOutputs(regex=self.guided_regex)
            if self.guided_choice is not None:
                return StructuredOutputs(choice=tuple(self.guided_choice))
            assert fmt is not None
            if fmt.type == "json_object":
                return StructuredOutputs(json_object=True)
            if fmt.json_schema is None:
                raise InvalidParam(asked[0], "'response_format' of type json_schema needs its 'json_schema'")
            return StructuredOutputs(json=fmt.json_schema.schema_)
        except Fp8InputError as exc:
            raise InvalidParam(asked[0], str(exc)) from None

    def logprobs_asked(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) for SamplingParams."""
        return None, self.prompt_logprobs

    # max_tokens when the request leaves it out: None, until the context is full (chat completions).
    default_max_tokens: ClassVar[int | None] = None

    def room_for(self, prompt_tokens: int, context: int) -> int | None:
        """max_tokens for a prompt of this many tokens in a context this long: as the request sent it,
        or the default capped to the room the prompt leaves (a value the client never sent must not be
        the reason it is refused)."""
        if prompt_tokens >= context:
            raise InvalidParam(
                "prompt", f"the prompt's {prompt_tokens} tokens fill the model's context of {context} tokens "
                "and leave none to generate; shorten the prompt",
            )  # fmt: skip
        if self.max_tokens is not None or self.default_max_tokens is None:
            return self.max_tokens
        return min(self.default_max_tokens, context - prompt_tokens)

    def sampling_params(self, prompt_tokens: int | None = None, context: int | None = None) -> SamplingParams:
        """The request's SamplingParams; given the prompt's length and the model's context, a
        max_tokens left out is fitted to them (room_for)."""
        logprobs, prompt_logprobs = self.logprobs_asked()
        if prompt_tokens is not None and context is not None:
            max_tokens = self.room_for(prompt_tokens, context)
        else:
            max_tokens = self.default_max_tokens if self.max_tokens is None else self.max_tokens
        try:
            return SamplingParams(
                n=self.n,
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=self.min_p or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                frequency_penalty=self.frequency_penalty or 0.0,
                presence_penalty=self.presence_penalty or 0.0,
                logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
                seed=self.seed,
                stop=tuple(self.stop),
                stop_token_ids=tuple(self.stop_token_ids),
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_outputs=self.structured_outputs(),
            )
        except Fp8InputError as exc:
            raise InvalidParam(None, str(exc).removeprefix("SamplingParams: ")) from None


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str | list[int]]  # text or token ids, or a batch of them
    default_max_tokens: ClassVar[int | None] = 16  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the top alternatives per token
    echo: bool = False  # the prompt before the completion, in the text and (with logprobs) the logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]  # a batch of one
        if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
            return [_one_prompt(v, f"prompt[{i}]") for i, v in enumerate(value)]
        return _one_prompt(value, "prompt")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt per item, each answered by its own choices."""
        one = isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int)
        return [cast("str | list[int]", self.prompt)] if one else list(cast("list[str | list[int]]", self.prompt))

    def logprobs_asked(self) -> tuple[int | None, int | None]:
        if self.echo and self.logprobs is not None:  # the prompt's tokens are scored as the output's are
            return self.logprobs, max(self.logprobs, self.prompt_logprobs or 0)
        return self.logprobs, self.prompt_logprobs


def _one_prompt(value: Any, where: str) -> str | list[int]:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if not value:
            raise InvalidParam("prompt", f"'{where}' is empty: give some text or at least one token id")
        return value
    if isinstance(value, str):
        if not value:
            raise InvalidParam("prompt", f"'{where}' is empty: give some text or at least one token id")
        return value
    raise InvalidParam("prompt", f"'{where}' must be a string or a list of token ids, got {short(value)}")


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
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def logprobs_asked(self) -> tuple[int | None, int | None]:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParam("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        return (self.top_logprobs or 0) if self.logprobs else None, self.prompt_logprobs

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


class CompletionLogprobs(BaseModel):
    """The completions API's (legacy) log-probabilities: per token its text, offset, value and top."""

    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry for one token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's, when asked for


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
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
