"""SamplingParams: how one request's tokens are chosen and when it stops, in vLLM's names and
defaults, each field checked once here with a one-line error. The sampler that applies them is
fp8route.engine.sampler."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

from fp8route.engine.structured import StructuredOutputs
from fp8route.errors import Fp8InputError

MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs, and vLLM's default max_logprobs
# OpenAI's bound, which the server's API is: offline and served requests take the same values.
MAX_TEMPERATURE = 2


@dataclass(frozen=True)
class Range:
    low: float
    high: float
    open_low: bool = False  # the low end itself is out

    def why_not(self, name: str, value: Any) -> str | None:
        """None when value is a number in the range, else the one line that says what it must be."""
        interval = f"{'(' if self.open_low else '['}{self.low:g}, {self.high:g}]"
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"{name} must be a number in {interval}, got {value!r}"
        if math.isnan(value):
            return f"{name} must be a number in {interval}, got NaN (not a number)"
        if value > self.high or value < self.low or (self.open_low and value == self.low):
            return f"{name} must be a number in {interval}, got {value!r}"
        return None


# The range of every float SamplingParams takes: what SamplingParams, the command line (through it)
# and the server's requests (fp8route.serve.protocol) check, the one statement of each.
RANGES = {
    "temperature": Range(0, MAX_TEMPERATURE),
    "top_p": Range(0, 1, open_low=True),
    "min_p": Range(0, 1),
    "repetition_penalty": Range(0, 100, open_low=True),
    "frequency_penalty": Range(-2, 2),
    "presence_penalty": Range(-2, 2),
}
BIAS_RANGE = Range(-100, 100)  # OpenAI's range of a logit_bias value


def _fail(message: str) -> NoReturn:
    raise Fp8InputError(f"SamplingParams: {message}")


def _number(name: str, value: Any, valid: Range) -> None:
    why = valid.why_not(name, value)
    if why is not None:
        _fail(why)


def stop_strings(value: Any) -> tuple[str, ...]:
    """`stop` as vLLM and OpenAI take it (a string, or a list of them) as a tuple; Fp8InputError names
    what is wrong with it."""
    if value is None:
        return ()
    strings = (value,) if isinstance(value, str) else value
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) for s in strings):
        raise Fp8InputError(f"stop must be a string or a list of strings, got {value!r:.60}")
    if "" in strings:
        raise Fp8InputError("stop holds an empty string, which would match everywhere; remove it")
    return tuple(strings)


def _count(name: str, value: Any, low: int, high: int | None = None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        _fail(f"{name} must be an integer {bound}{' (or None)' if optional else ''}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. The logits a token is drawn from are, in this order: biased
    (logit_bias), held back from EOS and stop ids before min_tokens, penalized for what the request
    saw (repetition on prompt and output, frequency and presence on output), masked to what the
    structured output allows; then divided by the temperature and cut by min_p, top_k and top_p.
    logprobs and prompt_logprobs report the model's own log-probabilities, before any of that."""

    n: int = 1  # samples of the prompt, which is prefilled once
    max_tokens: int | None = 16  # None: until the model's context is full
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None
    # Strings that end a sample where its text holds one (not returned): matched on the decoded text by
    # the front ends that hold the tokenizer, LLM and the server (fp8route.engine.detokenize.TextStream);
    # LLMEngine and AsyncLLM yield token ids and leave them to their caller.
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop ids are masked until this many tokens came
    logprobs: int | None = None  # per output token: its log-probability and this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        _count("n", self.n, 1, 128)
        _count("max_tokens", self.max_tokens, 1, optional=True)
        for name, valid in RANGES.items():
            _number(name, getattr(self, name), valid)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _count("top_k", self.top_k, 0)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            _fail(f"seed must be an integer or None, got {self.seed!r}")
        _count("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _count("logprobs", self.logprobs, 0, MAX_LOGPROBS, optional=True)
        _count("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, optional=True)
        try:
            object.__setattr__(self, "stop", stop_strings(self.stop))
        except Fp8InputError as exc:
            _fail(str(exc))
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not all(isinstance(i, int) and i >= 0 for i in ids):
            _fail(f"stop_token_ids must be a list of token ids >= 0, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        object.__setattr__(self, "logit_bias", _bias(self.logit_bias))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            _fail(f"structured_outputs must be a StructuredOutputs, got {type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @functools.cached_property  # read for every row of every step
    def penalized(self) -> bool:
        """Whether the tokens the request saw change its logits (its counts are kept on the device)."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @functools.cached_property
    def plain(self) -> bool:
        """Whether its logits are used as the model gave them (no bias, penalty, cut or mask)."""
        cut = self.top_p < 1 or self.top_k > 0 or self.min_p > 0
        return not (self.penalized or self.logit_bias or self.structured_outputs is not None or cut)

    def child(self, index: int) -> SamplingParams:
        """The params of sample `index` of n: one sample each, its own seed (seed + index) when seeded."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)


def _bias(bias: Any) -> dict[int, float] | None:
    """logit_bias as {token id: bias in [-100, 100]} (OpenAI's range); None when empty."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        _fail(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for token, value in bias.items():
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            _fail(f"logit_bias keys must be token ids >= 0, got {token!r}")
        _number(f"logit_bias[{token}]", value, BIAS_RANGE)
        out[token] = float(value)
    return out or None
