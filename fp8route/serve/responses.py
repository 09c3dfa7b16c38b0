"""The answer's shapes: a request's pieces as one completion or chat response, or as stream chunks,
with one choice per sample and the log-probabilities in the API's own form (the completions API's
tokens / token_logprobs / top_logprobs / text_offset, chat's content list with bytes, vLLM's
prompt_logprobs by token id). echo puts the prompt, and its log-probabilities, before a completion."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

from pydantic import BaseModel

from fp8route.engine.request import TokenLogprobs
from fp8route.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    PromptLogprob,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from fp8route.serve.serving import Job, Piece, Serving

_TEXT = "@@fp8route-text@@"
_FLOOR = -9999.0  # JSON has no -inf; vLLM reports an impossible token's log-probability as this


def sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def _value(logprob: float) -> float:
    return max(logprob, _FLOOR)


@dataclass
class Sample:
    """One sample's answer gathered whole: its text, tokens, log-probabilities and last piece."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    last: Piece | None = None


@dataclass
class Answer:
    samples: dict[int, Sample]
    last: Piece  # the request's last piece: its usage counts every sample
    prompt_logprobs: list[TokenLogprobs | None] | None


async def collect(pieces: AsyncIterator[Piece]) -> Answer:
    samples: dict[int, Sample] = {}
    last, prompt = None, None
    async for piece in pieces:
        sample = samples.setdefault(piece.index, Sample())
        sample.texts.append(piece.text)
        sample.token_ids += piece.token_ids
        sample.logprobs += piece.logprobs
        sample.last = last = piece
        prompt = piece.prompt_logprobs if piece.prompt_logprobs is not None else prompt
    assert last is not None, "the engine's stream ended without a last piece"
    return Answer(samples, last, prompt)


class _Envelope(TypedDict):
    """What every response object of one request carries besides its choices and usage."""

    id: str
    created: int
    model: str


class Formats:
    """The completion and chat shapes of one answer, whole or as stream chunks."""

    def __init__(
        self, job: Job, model: str, chat: bool, continuous_usage: bool, token_text: Callable[[int], str],
        echo: str | None = None,
    ) -> None:  # fmt: skip
        """token_text: a token id's text; echo: the prompt's text when the completion echoes it."""
        self.job, self.model, self.chat, self.continuous_usage = job, model, chat, continuous_usage
        self.token_text, self.echo = token_text, echo
        self.started: set[int] = set()  # samples whose first chunk went out
        self.offsets: dict[int, int] = {}  # each sample's text_offset so far
        self._template: tuple[str, str] | None = None

    @property
    def logprobs(self) -> bool:
        return self.job.params.logprobs is not None

    def _envelope(self) -> _Envelope:
        return {"id": self.job.request_id, "created": self.job.created, "model": self.model}

    def event(self, piece: Piece) -> str:
        """The piece as one server-sent event. A middle piece of a plain one-sample stream (no role,
        no usage, no logprobs, not the last) is the same chunk every time but for its text: a template
        filled in, not a model per token."""
        plain = piece.index == 0 and not self.logprobs and self.job.params.n == 1 and not self.continuous_usage
        if not plain or 0 not in self.started or piece.ends:
            return sse(self.chunk(piece))
        if self._template is None:
            head, _, tail = sse(self._chunk(Piece(_TEXT, 0, 0), first=False)).rpartition(json.dumps(_TEXT))
            self._template = head, tail
        head, tail = self._template
        return head + json.dumps(piece.text, ensure_ascii=False) + tail

    def chunk(self, piece: Piece) -> BaseModel:
        first = piece.index not in self.started
        self.started.add(piece.index)
        return self._chunk(piece, first)

    def _chunk(self, piece: Piece, first: bool) -> BaseModel:
        job, usage = self.job, piece.usage if self.continuous_usage else None
        if not self.chat:
            text, ids = piece.text, piece.token_ids
            entries: list[TokenLogprobs | None] = list(piece.logprobs)
            if first and self.echo is not None:
                text, ids = self.echo + text, job.prompt_ids + ids
                entries = [*(piece.prompt_logprobs or [None] * len(job.prompt_ids)), *entries]
            choice = CompletionChoice(
                index=piece.index, text=text, finish_reason=piece.finish_reason, stop_reason=piece.stop_reason,
                logprobs=self._completion_logprobs(piece.index, ids, entries) if self.logprobs else None,
            )  # fmt: skip
            return CompletionResponse(choices=[choice], usage=usage, **self._envelope())
        delta = Delta(role="assistant" if first else None, content=piece.text)
        chunk = ChatChunkChoice(
            index=piece.index, delta=delta, finish_reason=piece.finish_reason, stop_reason=piece.stop_reason,
            logprobs=self._chat_logprobs(piece.logprobs) if self.logprobs else None,
        )  # fmt: skip
        return ChatCompletionChunk(choices=[chunk], usage=usage, **self._envelope())

    def usage_chunk(self, piece: Piece) -> BaseModel:
        envelope, usage = self._envelope(), piece.usage
        if self.chat:
            return ChatCompletionChunk(choices=[], usage=usage, **envelope)
        return CompletionResponse(choices=[], usage=usage, **envelope)

    def whole(self, answer: Answer) -> ChatCompletionResponse | CompletionResponse:
        job, usage, envelope = self.job, answer.last.usage, self._envelope()
        prompt = self._prompt_logprobs(answer.prompt_logprobs) if job.params.prompt_logprobs is not None else None
        if self.chat:
            choices = [
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content="".join(s.texts)),
                    finish_reason=s.last.finish_reason if s.last else None,
                    stop_reason=s.last.stop_reason if s.last else None,
                    logprobs=self._chat_logprobs(s.logprobs) if self.logprobs else None,
                )  # fmt: skip
                for i, s in sorted(answer.samples.items())
            ]
            return ChatCompletionResponse(choices=choices, prompt_logprobs=prompt, usage=usage, **envelope)
        completions = []
        for i, s in sorted(answer.samples.items()):
            text, ids = "".join(s.texts), s.token_ids
            entries: list[TokenLogprobs | None] = list(s.logprobs)
            if self.echo is not None:
                text, ids = self.echo + text, job.prompt_ids + ids
                entries = [*(answer.prompt_logprobs or [None] * len(job.prompt_ids)), *entries]
            completions.append(
                CompletionChoice(
                    index=i,
                    text=text,
                    finish_reason=s.last.finish_reason if s.last else None,
                    stop_reason=s.last.stop_reason if s.last else None,
                    prompt_logprobs=prompt,
                    logprobs=self._completion_logprobs(i, ids, entries) if self.logprobs else None,
                )  # fmt: skip
            )
        return CompletionResponse(choices=completions, usage=usage, **envelope)

    def _completion_logprobs(
        self, index: int, ids: Sequence[int], entries: Sequence[TokenLogprobs | None]
    ) -> CompletionLogprobs:
        """The completions API's form: each token's text and offset, its value, and a dict of the top
        alternatives' texts (with the token itself, as vLLM gives it); None where nothing scored it."""
        out = CompletionLogprobs()
        offset = self.offsets.get(index, 0)
        for token, entry in zip(ids, entries, strict=False):
            text = self.token_text(token)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_value(entry.logprob))
            top = {self.token_text(t): _value(v) for t, v in zip(entry.top_ids, entry.top_logprobs, strict=True)}
            top.setdefault(text, _value(entry.logprob))
            out.top_logprobs.append(top)
        self.offsets[index] = offset
        return out

    def _chat_logprobs(self, entries: Sequence[TokenLogprobs]) -> ChatLogprobs:
        def top(token: int, value: float) -> TopLogprob:
            text = self.token_text(token)
            return TopLogprob(token=text, logprob=_value(value), bytes=list(text.encode()))

        content = [
            TokenLogprob(
                **top(e.token, e.logprob).model_dump(),
                top_logprobs=[top(t, v) for t, v in zip(e.top_ids, e.top_logprobs, strict=True)],
            )
            for e in entries
        ]
        return ChatLogprobs(content=content)

    def _prompt_logprobs(
        self, entries: Sequence[TokenLogprobs | None] | None
    ) -> list[dict[str, PromptLogprob] | None] | None:
        """vLLM's prompt_logprobs: per prompt token, {token id: {logprob, rank, decoded_token}}."""
        if entries is None:
            return None
        out: list[dict[str, PromptLogprob] | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            ranked = {
                str(t): PromptLogprob(logprob=_value(v), rank=r + 1, decoded_token=self.token_text(t))
                for r, (t, v) in enumerate(zip(e.top_ids, e.top_logprobs, strict=True))
            }
            ranked[str(e.token)] = PromptLogprob(
                logprob=_value(e.logprob), rank=e.rank, decoded_token=self.token_text(e.token)
            )
            out.append(ranked)
        return out


def batch_response(
    serving: Serving, body: CompletionRequest, jobs: Sequence[Job], answers: Sequence[Answer]
) -> CompletionResponse:
    """A batch of prompts' answers as one completion response: choice p * n + i is prompt p's sample i,
    the usage every prompt's."""
    n, choices = body.n, []
    prompt_tokens = completion_tokens = cached = 0
    for p, (job, answer) in enumerate(zip(jobs, answers, strict=True)):
        echo = serving.prompt_text(job.prompt_ids) if body.echo else None
        whole = Formats(job, body.model, False, False, serving.token_text, echo).whole(answer)
        assert isinstance(whole, CompletionResponse)
        for choice in whole.choices:
            choice.index += p * n
            choices.append(choice)
        usage = answer.last.usage
        prompt_tokens += usage.prompt_tokens
        completion_tokens += usage.completion_tokens
        cached += answer.last.cached_tokens
    usage = Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )  # fmt: skip
    first = jobs[0]
    return CompletionResponse(
        id=first.request_id, created=first.created, model=body.model, choices=choices, usage=usage
    )
