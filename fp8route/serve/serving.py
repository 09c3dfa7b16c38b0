"""A validated request through the engine: its prompt ids and SamplingParams, refused with a 400
before any work if it can never run (or a 503 if the queue is full), then each step's text as it
comes, detokenized and cut at a stop string, with what happened to it counted.

The admission limit counts the server's own in-flight requests as well as the engine's queue: the
engine only learns of a request at its next step, so a burst arriving within one step would
otherwise all see an empty queue.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8route.checkpoint.gguf_tokenizer import apply_chat_template
from fp8route.engine.async_llm import EngineClient, EngineError
from fp8route.engine.detokenize import TextStream
from fp8route.engine.llm_engine import sample_id
from fp8route.engine.request import TokenLogprobs
from fp8route.engine.sampling import SamplingParams
from fp8route.errors import Fp8InputError
from fp8route.serve.errors import APIError
from fp8route.serve.metrics import Metrics
from fp8route.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidParam,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
)

log = logging.getLogger("fp8route")
RETRY_AFTER_S = 1


@dataclass
class Job:
    """One admitted request: what the engine runs, and whether its place in the queue was given back."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    created: int = field(default_factory=lambda: int(time.time()))
    released: bool = False


@dataclass
class Piece:
    """One step's news for one sample (index) of a request: the text it lets out, its tokens and their
    log-probabilities when asked for, the token counts so far (every sample's), and on a sample's
    last piece why it ended. The first piece of a request carries the prompt's log-probabilities."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def ends(self) -> bool:
        """Whether this is its sample's last piece."""
        return self.finish_reason is not None

    @property
    def usage(self) -> Usage:
        # Built when a response asks for it (the last piece, or continuous usage), not per token.
        return Usage(
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )  # fmt: skip


class Serving:
    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        folder: Path,
        *,
        max_num_seqs: int,
        max_queue: int,
        tokenizer_config: dict[str, Any] | None = None,
    ) -> None:
        self.engine, self.model_name, self.folder = engine, model_name, folder
        self.tokenizer = engine.tokenizer
        self.max_num_seqs, self.max_queue = max_num_seqs, max_queue
        self.tokenizer_config = tokenizer_config
        self.in_flight = 0
        self.draining = False
        self.started = int(time.time())
        self.metrics = Metrics(engine, lambda: self.in_flight)
        # A token's own text, for log-probabilities: a few tokens per step, decoded once each.
        self.token_text: Callable[[int], str] = functools.lru_cache(maxsize=1 << 17)(self._token_text)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def prompt_text(self, prompt: str | list[int]) -> str:
        """A completion prompt as text (echo): as sent, or its token ids decoded."""
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=False)

    def models(self) -> ModelList:
        card = ModelCard(
            id=self.model_name, created=self.started, root=str(self.folder), max_model_len=self.engine.max_model_len
        )
        return ModelList(data=[card])

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404, f"the model '{name}' does not exist here; this server serves '{self.model_name}' (GET /v1/models)",
                param="model", code="model_not_found",
            )  # fmt: skip

    def completion_job(self, request: CompletionRequest, prompt: str | list[int]) -> Job:
        """A job for one prompt of the request (a batch is one job per prompt)."""
        self.check_model(request.model)
        ids = list(self.tokenizer.encode(prompt, add_special_tokens=False).ids) if isinstance(prompt, str) else prompt
        return self._admit("cmpl", ids, self._params(request, ids))

    def chat_job(self, request: ChatCompletionRequest) -> Job:
        self.check_model(request.model)
        if not self.tokenizer_config or not self.tokenizer_config.get("chat_template"):
            raise APIError(
                400, "this model has no chat template (its tokenizer_config.json has none); use /v1/completions"
            )
        try:
            text = apply_chat_template(self.tokenizer_config, [m.model_dump() for m in request.messages])
        except Fp8InputError as exc:
            raise APIError(400, str(exc), param="messages") from None
        ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return self._admit("chatcmpl", ids, self._params(request, ids))

    def _params(self, request: CompletionRequest | ChatCompletionRequest, ids: list[int]) -> SamplingParams:
        """The request's SamplingParams for this prompt; a combination of fields they refuse is the client's 400."""
        try:
            return request.sampling_params(len(ids), self.engine.max_model_len)
        except InvalidParam as exc:
            raise APIError(400, str(exc), param=exc.param, code=exc.code) from None

    def _admit(self, kind: str, ids: list[int], params: SamplingParams) -> Job:
        try:
            self.engine.check(ids, params)
        except Fp8InputError as exc:
            raise APIError(400, str(exc)) from None
        if self.draining:
            raise APIError(503, "the server is shutting down; send the request elsewhere or retry later",
                           code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
        # The engine's own queue counts where it holds requests back with seats free (a full KV pool);
        # requests it has not scheduled yet while seats are free are not waiting for capacity.
        now = self.engine.snapshot()
        waiting = max(self.in_flight - self.max_num_seqs, now.waiting - max(0, self.max_num_seqs - now.running))
        if waiting >= self.max_queue:
            raise APIError(
                503, f"the server is at capacity: {waiting} requests already wait (--max-queue {self.max_queue}); "
                f"retry in {RETRY_AFTER_S} s", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)},
            )  # fmt: skip
        self.in_flight += 1
        return Job(f"{kind}-{uuid.uuid4().hex}", ids, params)

    def release(self, job: Job, outcome: str) -> None:
        """Give the job's place back and count how it ended; only its first call counts."""
        if job.released:
            return
        job.released = True
        self.in_flight -= 1
        if outcome == "failed":
            self.metrics.failed.inc()
        elif outcome in ("aborted", "abort"):
            self.metrics.aborted.inc()
        else:
            self.metrics.success.labels(outcome).inc()

    async def pieces(self, job: Job) -> AsyncIterator[Piece]:
        """Each step's text for each sample of this job until all end; leaving early aborts the job,
        which frees its blocks. A sample that meets a stop string is aborted on its own."""
        n = job.params.n
        texts = [TextStream(self.tokenizer, job.prompt_ids, job.params.stop) for _ in range(n)]
        outputs = [0] * n
        ended: set[int] = set()
        stream = self.engine.generate(job.prompt_ids, job.params, job.request_id)
        outcome, last = "aborted", None
        try:
            async for out in stream:
                if out.index in ended or (not out.new_token_ids and not out.finished):
                    continue  # a prefill chunk that sampled nothing, or a sample already cut at a stop string
                now = time.monotonic()
                if last is not None:
                    self.metrics.itl.observe(now - last)
                last = now
                text = texts[out.index]
                outputs[out.index] = out.num_output_tokens
                piece = Piece(
                    text.push(out.new_token_ids, final=out.finished), out.num_prompt_tokens, sum(outputs),
                    out.num_cached_tokens, index=out.index, token_ids=out.new_token_ids, logprobs=out.new_logprobs,
                    prompt_logprobs=out.prompt_logprobs,
                )  # fmt: skip
                if text.stop_reason is not None:
                    piece.finish_reason, piece.stop_reason = "stop", text.stop_reason
                    if not out.finished and n > 1:  # the last sample's stop ends the stream, which aborts
                        self.engine.abort(sample_id(job.request_id, out.index, n))
                elif out.finished:
                    piece.finish_reason, piece.stop_reason = out.finish_reason or "unknown", out.stop_reason
                if piece.ends:
                    ended.add(out.index)
                    outcome = piece.finish_reason or outcome
                yield piece
                if len(ended) == n:
                    return  # leaving the engine's stream aborts what is left of the request
        except EngineError:
            outcome = "failed"
            raise
        finally:
            await stream.aclose()  # type: ignore[attr-defined]  # generate is an async generator
            self.release(job, outcome)
