"""The engine in a process of its own, for the server.

Under load a server's event loop streams a token to every running request each step, which is
Python work on the scale of the step's own host work; in one process the engine's thread waits for
the GIL behind it, and the server's throughput falls well short of the offline engine's (the
figures: docs/serve.md). So, as vLLM and SGLang do, the engine
runs in a child process (an AsyncLLM there: its step loop on a thread, the pipe read on another)
and the server's process keeps the HTTP work, the tokenizer and each request's stream.

Messages, pickled through two pipes: to the child ("add", (id, ids, params, arrival)),
("abort", id), ("stop", None); from it, once ("ready", EngineLimits) or ("refused", message) or
("failed", message), then ("out", [(id, StreamOutput | EngineError)], EngineStats,
[RequestMetrics of requests finished]) once per step. The child ignores SIGINT and SIGTERM (the
server drains first, then stops it) and exits when its parent's pipe closes.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from fp8route.checkpoint.formats import CONFIG, read_json
from fp8route.engine.async_llm import AsyncLLM, EngineClient, EngineError, EngineStats, StreamOutput
from fp8route.engine.config import EngineConfig
from fp8route.engine.llm_engine import EngineLimits, check_prompt
from fp8route.engine.request import RequestMetrics
from fp8route.engine.sampling import SamplingParams
from fp8route.engine.structured import Grammars
from fp8route.errors import Fp8InputError, Fp8RouteError
from fp8route.linear.policy import Policy
from fp8route.models.tokenizer import load_tokenizer


class EngineProcess(EngineClient):
    """AsyncLLM's interface (generate, abort, check, snapshot, on_finished) over an engine running
    LLM(folder, policy=policy, config=config) in a child process. Raises Fp8InputError if the child
    refuses the model."""

    def __init__(self, folder: Path, config: EngineConfig, policy: Policy | None = None) -> None:
        super().__init__()
        read_json(folder / CONFIG)  # a missing folder is named as LLM names it, not as a missing tokenizer
        self.tokenizer = load_tokenizer(folder)
        self._grammars: Grammars | None = None
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        child_in, self._to_child = context.Pipe(duplex=False)
        self._from_child, child_out = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_child_main, args=(child_in, child_out, str(folder), config, policy), name="fp8route-engine"
        )
        self._process.start()
        child_in.close()
        child_out.close()
        self._send_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._join_lock = threading.Lock()
        self._stopped = False
        try:
            kind, payload = self._from_child.recv()
        except EOFError:
            self._process.join(timeout=10)
            raise Fp8RouteError(
                f"the engine process exited (code {self._process.exitcode}) while loading {folder}; its output "
                "above says why"
            ) from None
        if kind != "ready":
            self._process.join(timeout=10)
            raise (Fp8InputError if kind == "refused" else Fp8RouteError)(payload)
        self.limits: EngineLimits = payload
        self._stats = EngineStats(kv_total_blocks=self.limits.usable_blocks)
        self._reader = threading.Thread(target=self._read, name="fp8route-engine-reader", daemon=True)
        self._reader.start()

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def capacity_tokens(self) -> int:
        return self.limits.capacity_tokens

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        grammars = None
        if params.structured_outputs is not None:  # compiled here too: a schema that fails is a 400
            if self._grammars is None:
                limits = self.limits
                self._grammars = Grammars(self.tokenizer, limits.vocab_size, limits.eos_token_ids)
            grammars = self._grammars
        check_prompt(list(prompt_ids), params, self.limits, grammars)

    def snapshot(self) -> EngineStats:
        with self._stats_lock:
            stats = self._stats
        return EngineStats(**{**stats.__dict__, "finished": dict(stats.finished)})

    @property
    def alive(self) -> bool:
        """False once the engine process has stopped: shut down, or died."""
        return not self._stopped and self._process.is_alive() and self._reader.is_alive()

    @property
    def idle(self) -> bool:
        stats = self.snapshot()
        return not self._streams and not stats.running and not stats.waiting

    def shutdown(self) -> None:
        with contextlib.suppress(Fp8RouteError):  # already gone
            self._send("stop", None)
        self._join(10)
        if self._process.is_alive():
            self._process.kill()
            self._join(None)
        self._stopped = True

    def _join(self, timeout: float | None) -> None:
        """Wait for the child, one thread at a time: two threads waiting at once race to reap it, and the
        one that loses reads no exit code."""
        with self._join_lock:
            self._process.join(timeout)

    def _send(self, kind: str, payload: object) -> None:
        try:
            with self._send_lock:
                self._to_child.send((kind, payload))
        except (OSError, ValueError):
            # A stopped engine runs nothing to abort: a stream left after it died (its finally aborts) must
            # close quietly, not raise over the error it got (or a cancellation) and skip its caller's cleanup.
            if kind == "abort":
                return
            raise EngineError(f"the engine process has stopped (exit code {self._process.exitcode})") from None

    def _read(self) -> None:
        while True:
            try:
                _, items, stats, finished = self._from_child.recv()
            except (EOFError, OSError):
                break
            with self._stats_lock:
                self._stats = stats
            for metrics in finished:
                for callback in self.on_finished:
                    callback(metrics)
            self._deliver_all(items)
        self._join(5)
        gone = EngineError(f"the engine process stopped (exit code {self._process.exitcode})")
        self._deliver_all([(request_id, gone) for request_id in list(self._streams)])


class _PipedEngine(AsyncLLM):
    """The child's AsyncLLM: what it would deliver to streams goes down the pipe instead, with the
    stats and the finished requests' times."""

    def __init__(self, llm: Any, out: Connection) -> None:
        self._out = out
        self._finished: list[RequestMetrics] = []
        self._sent: EngineStats | None = None
        super().__init__(llm)
        self.on_finished.append(self._finished.append)

    def _deliver_all(self, items: Sequence[tuple[str, StreamOutput | BaseException]]) -> None:
        finished = self._finished[:]
        self._finished.clear()
        self._sent = self.snapshot()
        self._out.send(("out", list(items), self._sent, finished))

    def _count(self) -> None:
        super()._count()
        # A step sends the stats with its tokens; an engine gone idle (the last request aborted or
        # finished) sends them once, or the server would go on reading a busy pool.
        if not self.engine.has_unfinished and self.snapshot() != self._sent:
            self._deliver_all([])


def _child_main(inbox: Connection, out: Connection, folder: str, config: EngineConfig, policy: Policy | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from fp8route.engine.llm import LLM

    try:
        # The server's process detokenizes.
        llm = LLM(folder, policy=policy, config=config.replace(skip_tokenizer_init=True))
    except Fp8InputError as exc:
        out.send(("refused", str(exc)))
        return
    except Exception as exc:  # noqa: BLE001 (sent to the parent, which raises it)
        out.send(("failed", f"the engine could not load {folder}: {type(exc).__name__}: {exc}"))
        return
    out.send(("ready", llm.engine.limits))  # first: the engine's thread may send its stats at once
    engine = _PipedEngine(llm, out)
    try:
        while True:
            try:
                kind, payload = inbox.recv()
            except EOFError:
                break  # the server's process is gone
            if kind == "stop":
                break
            engine._send(kind, payload)
    finally:
        engine.shutdown()
