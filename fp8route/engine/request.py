"""A request's state inside the engine, and the outputs users read (in vLLM's shape)."""

from __future__ import annotations

import enum
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, overload

from fp8route.engine.blocks import ROOT
from fp8route.engine.sampling import SamplingParams


class TokenLogprobs(NamedTuple):
    """One position's log-probabilities, from the model's logits before any processing: the token's
    own, its rank (1 is the most likely), and the most likely tokens' (ids and values, best first)."""

    token: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


class OutputLogprobs(Sequence[TokenLogprobs]):
    """A request's TokenLogprobs, one per output token, held as columns of numbers. Python's collector
    tracks every TokenLogprobs (a tuple subclass) for as long as it lives: a load that keeps one per
    generated token makes each full collection longer, and collections stall steps. Six arrays are six
    objects to it, however long the generation."""

    __slots__ = ("_token", "_logprob", "_rank", "_top_ids", "_top_logprobs", "_ends")

    def __init__(self) -> None:
        self._token, self._rank, self._top_ids = array("q"), array("q"), array("q")
        self._logprob, self._top_logprobs = array("d"), array("d")
        self._ends = array("q")  # where each entry's top ids end in _top_ids

    def append(self, entry: TokenLogprobs) -> None:
        self._token.append(entry.token)
        self._logprob.append(entry.logprob)
        self._rank.append(entry.rank)
        self._top_ids.extend(entry.top_ids)
        self._top_logprobs.extend(entry.top_logprobs)
        self._ends.append(len(self._top_ids))

    def __len__(self) -> int:
        return len(self._token)

    @overload
    def __getitem__(self, index: int) -> TokenLogprobs: ...
    @overload
    def __getitem__(self, index: slice) -> list[TokenLogprobs]: ...
    def __getitem__(self, index: int | slice) -> TokenLogprobs | list[TokenLogprobs]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = range(len(self))[index]  # an IndexError past the end, as a list's
        start, end = self._ends[i - 1] if i else 0, self._ends[i]
        top = tuple(self._top_ids[start:end]), tuple(self._top_logprobs[start:end])
        return TokenLogprobs(self._token[i], self._logprob[i], self._rank[i], *top)

    def __iter__(self) -> Iterator[TokenLogprobs]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)


class Status(enum.Enum):
    WAITING = "waiting"  # queued, holds nothing
    RUNNING = "running"  # holds a table row and blocks
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Host clock times (time.monotonic()) as vLLM's RequestOutput.metrics names them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # params.seed, or one drawn at arrival: each request samples from its own stream
    metrics: RequestMetrics
    prompt: str | None = None
    max_tokens: int = 0  # params.max_tokens, or what the context leaves
    token_ids: list[int] = field(default_factory=list)  # prompt, then the output the host has read back
    num_pending: int = 0  # tokens sampled by launched steps, not yet read back (they follow token_ids)
    num_computed: int = 0  # positions whose K/V are in the cache or being written by a launched step
    blocks: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # blocks[:n] are registered in the prefix cache
    last_key: int = ROOT  # the key id of blocks[num_cached_blocks - 1]
    row: int | None = None  # table row while running
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | None = None  # the stop token id that ended it, if one did
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the last admission
    num_preemptions: int = 0
    group_id: str = ""  # the request the caller added: itself, or the parent of n samples
    index: int = 0  # which of its group's samples it is
    matcher: Any = None  # fp8route.engine.structured.Matcher when a grammar constrains the output
    logprobs: OutputLogprobs | None = None  # one per output token read back, when asked for
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token (the first has none)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.group_id = self.group_id or self.request_id
        if self.params.logprobs is not None:
            self.logprobs = OutputLogprobs()
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def length(self) -> int:
        """Tokens so far, those still on their way back from the device included."""
        return len(self.token_ids) + self.num_pending

    @property
    def remaining(self) -> int:
        """Positions still to compute before the next token can be sampled (1 when decoding)."""
        return self.length - self.num_computed

    @property
    def num_output_scheduled(self) -> int:
        """Output tokens read back or on their way."""
        return self.length - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(frozen=True)
class Logprob:
    """vLLM's Logprob: a token's log-probability, its rank among the vocabulary, its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprob_dict(entry: TokenLogprobs, decode: Callable[[int], str] | None) -> dict[int, Logprob]:
    """One position as vLLM gives it: the token chosen (or scored) and the top alternatives by id."""

    def text(token: int) -> str | None:
        return decode(token) if decode is not None else None

    out = {t: Logprob(lp, rank + 1, text(t)) for rank, (t, lp) in enumerate(zip(entry.top_ids, entry.top_logprobs))}
    out[entry.token] = Logprob(entry.logprob, entry.rank, text(entry.token))
    return out


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    # The sampled tokens' log-probabilities summed (vLLM's); None when logprobs were not asked for.
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """One prompt's result: vLLM's RequestOutput (outputs[0] holds the completion), with its
    text, token ids and finish reason also at the top level."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
