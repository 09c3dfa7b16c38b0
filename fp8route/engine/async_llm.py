"""AsyncLLM: the engine on a thread of its own, for a server.

`async for out in engine.generate(ids, params)` yields each step's new tokens as they come; leaving
the loop early (a client gone, a stop string found) aborts the request, which frees its blocks
before the next step. Requests and aborts reach the engine thread through a queue it drains
before every step; its outputs reach each request's asyncio queue through the event loop. An
exception inside a step fails the requests that step ran (their iterators raise EngineError
naming it) and the engine goes on with the rest.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from fp8route.engine.llm import LLM
from fp8route.engine.llm_engine import Update
from fp8route.engine.request import Request, RequestMetrics, TokenLogprobs
from fp8route.engine.sampling import SamplingParams
from fp8route.errors import Fp8RouteError

log = logging.getLogger("fp8route")


class EngineError(Fp8RouteError, RuntimeError):
    """The engine failed while running a request; the message names the exception."""


@dataclass
class StreamOutput:
    """One step's news for one sample (index) of a request; the prompt's log-probabilities come once,
    with its first sample's first news."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    index: int = 0
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class EngineStats:
    """Counters since start, and the state now: what /metrics reports."""

    running: int = 0
    waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    preemptions: int = 0
    steps_launched_ahead: int = 0  # async scheduling's steps launched before the one before was read back


_Queue = asyncio.Queue[StreamOutput | BaseException]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: _Queue


class EngineClient:
    """An engine as a server sees it, on the asyncio side: each request's stream, fed from another
    thread by _deliver_all. AsyncLLM runs the engine on a thread of this process; EngineProcess
    (fp8route.engine.engine_process) in a process of its own."""

    tokenizer: Any

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self.on_finished: list[Callable[[RequestMetrics], None]] = []  # each finished request's times

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise Fp8InputError now if the request could never run (the server's 400)."""
        raise NotImplementedError

    @property
    def max_model_len(self) -> int:
        raise NotImplementedError

    def snapshot(self) -> EngineStats:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def _send(self, kind: str, payload: object) -> None:
        raise NotImplementedError

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[StreamOutput]:
        """Each step's news for this request until all its samples finish; abandoning the iterator aborts it."""
        ids = list(prompt_ids)
        self.check(ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._send("add", (request_id, ids, params, time.monotonic()))
        finished = 0
        try:
            while finished < params.n:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished += item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if finished < params.n:
                self._send("abort", request_id)

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def _deliver(self, request_id: str, item: StreamOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: Sequence[tuple[str, StreamOutput | BaseException]]) -> None:
        # One wake-up of each event loop per step, not one per request: each costs the loop a
        # self-pipe write and the engine's thread the GIL.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Queue, StreamOutput | BaseException]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, pairs in by_loop.items():
            loop.call_soon_threadsafe(_put_all, pairs)


class AsyncLLM(EngineClient):
    def __init__(self, llm: LLM) -> None:
        super().__init__()
        self.llm = llm
        self.engine = llm.engine
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards stats against the reader
        self.stats = EngineStats(kv_total_blocks=llm.engine.blocks.usable_blocks)
        self._thread = threading.Thread(target=self._loop, name="fp8route-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self.engine.check_prompt(list(prompt_ids), params)

    def snapshot(self) -> EngineStats:
        with self._lock:
            return EngineStats(**{**self.stats.__dict__, "finished": dict(self.stats.finished)})

    @property
    def alive(self) -> bool:
        """False once the engine thread has stopped: shut down, or died outside a step."""
        return self._thread.is_alive()

    @property
    def idle(self) -> bool:
        return not self._streams and not self.engine.has_unfinished

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def _send(self, kind: str, payload: object) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    def _drain(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.engine.abort(str(payload))
                continue
            request_id, ids, params, arrival = cast(tuple[str, list[int], SamplingParams, float], payload)
            try:
                self.engine.add_request(ids, params, request_id=request_id, arrival_time=arrival)
            except Exception as exc:  # checked before queueing; anything left is the engine's own fault
                self._deliver(request_id, EngineError(f"request {request_id} was refused: {exc}"))

    def _loop(self) -> None:
        device = self.engine.kv_cache.device  # indexed, where the engine's own may be plain "cuda"
        if device.type == "cuda":  # a new thread has no current CUDA context; cuBLAS warns and makes one
            torch.cuda.set_device(device)
            self.engine.runner.warm_fresh_route()  # cuDNN's plans are per thread
        while not self._stop.is_set():
            self._drain()
            self._count()
            if not self.engine.has_unfinished:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            ran = list(self.engine.scheduler.running)
            try:
                updates = self.engine.step()
            except Exception as exc:  # noqa: BLE001 (one bad step must not take the server down)
                log.exception("engine step failed")
                touched = {id(r): r for r in [*ran, *self.engine.scheduler.running]}  # admitted by this step too
                self._fail(list(touched.values()), exc)
                continue
            self._count()  # before the news goes out: a client that reads /metrics next sees this step
            self._deliver_all([self._publish(u) for u in updates])

    def _publish(self, update: Update) -> tuple[str, StreamOutput]:
        request, new, finished = update.request, update.new_token_ids, update.finished
        with self._lock:
            self.stats.generation_tokens += len(new)
            if finished and request.index == 0:  # a request's prompt counts once, whatever its n
                self.stats.prompt_tokens += request.num_prompt_tokens
                reason = request.finish_reason or "unknown"
                self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        if finished:
            for callback in self.on_finished:
                callback(request.metrics)
        first_news = request.num_output_tokens == len(new) and bool(new or finished)
        output = StreamOutput(
            request.group_id, new, finished, request.finish_reason, request.stop_reason, request.num_prompt_tokens,
            request.num_output_tokens, request.num_cached_tokens, request.index, update.new_logprobs,
            request.prompt_logprobs if first_news else None,
        )  # fmt: skip
        return request.group_id, output

    def _fail(self, requests: list[Request], exc: Exception) -> None:
        for group in {request.group_id for request in requests}:
            self.engine.abort(group)
            error = EngineError(f"the engine failed running request {group}: {type(exc).__name__}: {exc}")
            self._deliver(group, error)

    def _count(self) -> None:
        engine, blocks = self.engine, self.engine.blocks
        with self._lock:
            self.stats.running, self.stats.waiting = engine.num_running, engine.num_waiting
            self.stats.kv_used_blocks = blocks.used_blocks
            self.stats.prefix_queried_tokens = blocks.stats.queried_tokens
            self.stats.prefix_hit_tokens = blocks.stats.hit_tokens
            self.stats.preemptions = engine.scheduler.preemptions
            self.stats.steps_launched_ahead = engine.ahead_steps


def _put_all(pairs: list[tuple[_Queue, StreamOutput | BaseException]]) -> None:
    for queue_, item in pairs:
        queue_.put_nowait(item)
