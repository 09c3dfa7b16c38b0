"""`fp8route bench serve` on the offline engine: one arm (a policy and an EngineConfig) run in its own
process over a load, with what its figures are compared with measured in the same process: a lone
prefill's speed, the static generate's output speed at a fixed batch, the floor of every decode step
(weights plus the KV it reads, over the copy bandwidth of this run), and the load's own bound.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fp8route.bench.e2e import FORCE_ENV, model_scheme, timed_calls, weight_bytes
from fp8route.bench.workload import LoadRequest, RequestResult, ServeReport, summarize
from fp8route.device import default_device
from fp8route.engine.config import EngineConfig
from fp8route.engine.generate import generate
from fp8route.engine.llm import LLM
from fp8route.engine.llm_engine import StepStats
from fp8route.engine.request import Request
from fp8route.engine.sampling import SamplingParams
from fp8route.engine.step_cost import copy_gbs as measured_copy_gbs
from fp8route.engine.structured import StructuredOutputs
from fp8route.kernels.launcher import first_launched, first_launches
from fp8route.linear.policy import Policy


@dataclass(frozen=True)
class Arm:
    name: str  # shown in the report
    policy: str  # routed, bf16, or a backend forced for every layer
    folder: Path
    config: EngineConfig
    lone_prefill: int = 0  # tokens of the lone prefill to time (0: none)
    static_batch: int = 0  # rows of the static generate to time (0: none)
    sampling: str = "greedy"  # what each request asks for: one of SAMPLINGS


SAMPLINGS = ("greedy", "mixed", "json")
# The json arm's schema: a list of short strings a model can go on adding to, so that a fixed output
# length is spent inside the grammar (what its masks cost), not after it ends.
JSON_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 16}}},
    "required": ["items"],
}
# The mixed arm's controls, a third of the requests each; every one also asks for logprobs=5.
MIXED: tuple[dict[str, Any], ...] = (
    {"top_k": 40, "top_p": 0.9},
    {"top_p": 0.95, "repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.2},
    {"min_p": 0.05, "top_k": 20, "repetition_penalty": 1.05},
)


def sampling_params(sampling: str, item: LoadRequest, index: int) -> SamplingParams:
    """Request `index`'s params under the arm's sampling: greedy; mixed controls; or a JSON schema."""
    params = functools.partial(SamplingParams, max_tokens=item.output_len, ignore_eos=True)
    if sampling == "greedy":
        return params(temperature=0)
    if sampling == "json":
        return params(temperature=0.8, seed=index, structured_outputs=StructuredOutputs(json=JSON_SCHEMA))
    return params(temperature=0.8, seed=index, logprobs=5, **MIXED[index % len(MIXED)])


def drive(llm: LLM, load: list[LoadRequest], sampling: str = "greedy") -> tuple[list[RequestResult], float, list[str]]:
    """Run the load through the engine, each request added at its arrival time; (results, duration,
    a digest of each request's output tokens)."""
    engine = llm.engine
    pending = deque(sorted(enumerate(load), key=lambda item: item[1].arrival_s))
    times: dict[str, list[float]] = {}
    arrivals: dict[str, float] = {}
    done: dict[str, Request] = {}
    start = time.monotonic()
    while pending or engine.has_unfinished:
        now = time.monotonic()
        while pending and start + pending[0][1].arrival_s <= now:
            index, item = pending.popleft()
            params = sampling_params(sampling, item, index)
            arrival = start + item.arrival_s  # as the client saw it, even if a step ran meanwhile
            request = engine.add_request(item.prompt_ids, params, request_id=str(index), arrival_time=arrival)
            arrivals[request.request_id], times[request.request_id] = arrival, []
        if not engine.has_unfinished:
            time.sleep(max(0.0, start + pending[0][1].arrival_s - time.monotonic()))
            continue
        updates = engine.step()
        stamp = time.monotonic()
        for update in updates:
            times[update.request.request_id] += [stamp] * len(update.new_token_ids)
            if update.finished:
                done[update.request.request_id] = update.request
    duration = time.monotonic() - start
    results, digests = [], []
    for index, item in enumerate(load):
        rid = str(index)
        finished, stamps = done.get(rid), times.get(rid, [])
        if finished is None or not stamps:
            results.append(RequestResult(len(item.prompt_ids), 0, item.output_len, 0.0, 0.0, error="never finished"))
            digests.append("")
            continue
        itl = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        results.append(
            RequestResult(
                len(item.prompt_ids),
                len(stamps),
                item.output_len,
                stamps[0] - arrivals[rid],
                stamps[-1] - arrivals[rid],
                itl,
                cached_tokens=request.num_cached_tokens,
            )  # fmt: skip
        )
        digests.append(hashlib.sha1(str(finished.output_token_ids).encode()).hexdigest()[:12])
    return results, duration, digests


def _lone_prefill_tok_s(llm: LLM, tokens: int) -> float:
    """One fresh prompt of `tokens` alone through the engine to its first token: tokens/s."""
    vocab = llm.engine.model.cfg.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def once() -> None:
        llm.generate([torch.randint(0, vocab, (tokens,)).tolist()], params, use_tqdm=False)

    times, _ = timed_calls(once, repeats=5)
    return tokens / statistics.median(times)


def _static_generate(llm: LLM, batch: int, input_len: int, output_len: int) -> dict[str, float]:
    """The static generate at this batch: output tokens/s over the whole call (prefill included,
    as a served load's output tokens/s is) and its decode step. Fresh prompts each call."""
    engine = llm.engine

    def prompts() -> torch.Tensor:
        return torch.randint(0, engine.model.cfg.vocab_size, (batch, input_len))

    fulls, _ = timed_calls(lambda: generate(engine, prompts(), output_len), repeats=3)
    ones, _ = timed_calls(lambda: generate(engine, prompts(), 1), repeats=3)
    full, one = statistics.median(fulls), statistics.median(ones)
    return {"output_tok_s": batch * output_len / full, "step_ms": 1e3 * (full - one) / max(1, output_len - 1)}


def load_bound(llm: LLM, load: list[LoadRequest], lone_tok_s: float, copy_gbs: float) -> float:
    """The output tokens/s this load allows: every prompt at the lone-prefill rate, then its decodes in
    the longer of two: every output token's KV read plus the weights once per step of max_num_seqs rows at
    copy bandwidth, or the output tokens' own GEMMs at the lone-prefill rate (the larger at high concurrency)."""
    per_token = llm.engine.kv_cache.bytes_per_token
    outputs = sum(r.output_len for r in load)
    prefill_s = sum(len(r.prompt_ids) for r in load) / lone_tok_s
    kv = sum(per_token * (r.output_len * len(r.prompt_ids) + r.output_len * (r.output_len - 1) / 2) for r in load)
    steps = -(-outputs // llm.config.max_num_seqs)
    decode_s = max((steps * weight_bytes(llm.engine.model) + kv) / (copy_gbs * 1e9), outputs / lone_tok_s)
    return outputs / (prefill_s + decode_s)


def _step_floors(llm: LLM, stats: list[StepStats], copy_gbs: float) -> dict[str, float]:
    """Pure decode steps (a decode graph's, no prefill chunk) against their floor: (weights + the KV
    they read) / copy bandwidth; and how many steps were mixed (decodes and prefill chunks in one forward)."""
    per_token = llm.engine.kv_cache.bytes_per_token
    weights = weight_bytes(llm.engine.model)
    decode = [s for s in stats if s.decodes and not s.prefill_tokens]
    if not decode:
        return {}
    read = [weights + s.decode_context * per_token for s in decode]
    floors = [nbytes / (copy_gbs * 1e9) for nbytes in read]
    walls = [s.wall_s for s in decode]
    mixed = [s.wall_s for s in stats if s.decodes and s.prefill_tokens]
    return {
        "decode_steps": len(decode),
        "mixed_steps": len(mixed),
        "mixed_step_ms": 1e3 * statistics.fmean(mixed) if mixed else 0.0,
        "steps": len(stats),
        "decode_step_ms": 1e3 * statistics.fmean(walls),
        "decode_floor_ms": 1e3 * statistics.fmean(floors),
        "decode_over_floor": statistics.fmean(w / f for w, f in zip(walls, floors, strict=True)),
        "decode_gbs": statistics.fmean(n / w / 1e9 for n, w in zip(read, walls, strict=True)),
        "decode_batch_mean": statistics.fmean(s.decodes for s in decode),
        "host_ms_mean": 1e3 * statistics.fmean(s.host_s for s in stats),
        "decode_host_ms_mean": 1e3 * statistics.fmean(s.host_s for s in decode),
        **_percentiles("decode_host_ms", [s.host_s for s in decode]),
        **_percentiles("decode_step_ms", walls),
    }


def _percentiles(name: str, seconds: list[float]) -> dict[str, float]:
    """p50, p90 and the maximum of some steps' times, in ms: a mean hides the few steps that take far longer."""
    cuts = statistics.quantiles(seconds, n=10, method="inclusive") if len(seconds) > 1 else seconds * 9
    return {f"{name}_p50": 1e3 * cuts[4], f"{name}_p90": 1e3 * cuts[8], f"{name}_max": 1e3 * max(seconds)}


class _Collections:
    """The time Python's garbage collector runs inside a `with` block: in all, and in full (generation 2)
    collections."""

    def __init__(self) -> None:
        self.full_s = self.all_s = 0.0
        self.full = 0
        self._start = 0.0

    def _note(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        spent = time.perf_counter() - self._start
        self.all_s += spent
        if info["generation"] == 2:
            self.full_s += spent
            self.full += 1

    def __enter__(self) -> _Collections:
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._note)


def _prefill_steps(stats: list[StepStats]) -> dict[str, float]:
    """Steps with prefill chunks: their prompt tokens over their own time (what a lone prefill's speed
    compares with, before the decode-only steps and the tail count), and their host time."""
    steps = [s for s in stats if s.prefill_tokens]
    if not steps:
        return {}
    wall = sum(s.wall_s for s in steps)
    return {
        "prefill_steps": len(steps),
        "prefill_step_ms": 1e3 * wall / len(steps),
        "prefill_tok_s_in_steps": sum(s.prefill_tokens for s in steps) / wall,
        "prefill_host_ms_mean": 1e3 * statistics.fmean(s.host_s for s in steps),
    }


def _unloaded(llm: LLM, load: list[LoadRequest], probes: int = 5) -> dict[str, float]:
    """TTFT and inter-token latency of a request of the load's mean length, alone: what a loaded
    run's latencies are compared with."""
    mean_in = round(statistics.fmean(len(r.prompt_ids) for r in load))
    ttft, itl = [], []
    for i in range(probes):
        alone = [LoadRequest(load[i % len(load)].prompt_ids[:mean_in] or [0], 16, 0.0)]
        results, _, _ = drive(llm, alone)
        ttft.append(results[0].ttft_s)
        itl += results[0].itl_s
    return {"unloaded_ttft_ms": 1e3 * statistics.median(ttft), "unloaded_itl_ms": 1e3 * statistics.median(itl)}


def _alloc_retries(cuda: bool) -> int:
    """Allocations torch's CUDA allocator retried after freeing its cache (each a device sync)."""
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0)) if cuda else 0


def run_arm(arm: Arm, load: list[LoadRequest], warmup: list[LoadRequest]) -> tuple[ServeReport, list[str]]:
    """One arm, in this process: load the model under the arm's policy, warm up, measure."""
    forced = arm.policy not in ("routed", "bf16")
    if forced:
        os.environ[FORCE_ENV] = arm.policy
    else:
        os.environ.pop(FORCE_ENV, None)
    config = arm.config.replace(skip_tokenizer_init=True, record_stats=True)
    device = default_device(config.device)
    cuda = device.type == "cuda"
    copy_gbs = measured_copy_gbs(device, 1 << 30) if cuda else 0.0  # before the engine's pool takes the memory
    llm = LLM(arm.folder, policy=Policy.from_env(), config=config)
    engine = llm.engine
    pool = engine.kv_cache
    extra: dict[str, Any] = {
        "policy": arm.policy, "prefix_caching": config.enable_prefix_caching, "kv_cache_dtype": config.kv_cache_dtype,
        "async_scheduling": engine.async_scheduling, "prefill_graphs": config.prefill_graphs,
        "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "kv_cache_tokens": pool.capacity_tokens, "sampling": arm.sampling, "scheme": model_scheme(engine.model),
    }  # fmt: skip
    drive(llm, warmup, arm.sampling)  # kernels' first calls (and grammars' compiles), at the load's sizes
    extra.update(_unloaded(llm, load))
    engine.stats.clear()
    if arm.lone_prefill:
        extra["lone_prefill_tokens"] = arm.lone_prefill
        extra["lone_prefill_tok_s"] = _lone_prefill_tok_s(llm, arm.lone_prefill)
    if arm.static_batch:
        mean_in = round(statistics.fmean(len(r.prompt_ids) for r in load))
        mean_out = max(2, round(statistics.fmean(r.output_len for r in load)))
        extra["static_batch"] = arm.static_batch
        extra.update({f"static_{k}": v for k, v in _static_generate(llm, arm.static_batch, mean_in, mean_out).items()})
    engine.blocks.reset_prefix_cache()  # the load starts with an empty prefix cache
    engine.scheduler.preemptions = 0
    launched, retries = first_launches(), _alloc_retries(cuda)
    with _Collections() as collected:
        results, duration, digests = drive(llm, load, arm.sampling)
    stats = engine.stats
    extra.update(
        {
            "kv_pool_tokens": pool.capacity_tokens,
            "kv_pool_peak_use": max((s.used_blocks for s in stats), default=0) / max(1, pool.num_blocks - 1),
            "prefix_hit_rate": engine.blocks.stats.hit_rate,
            "leaked": engine.leaked() or "",
            "preemptions": engine.scheduler.preemptions,
            "kernel_first_launches": first_launches() - launched,  # kernel variants met only under the load
            "kernels_first_launched": first_launched(launched),
            "alloc_retries": _alloc_retries(cuda) - retries,  # torch's allocator freed its cache to retry
            "gc_s": collected.all_s,
            "gc_full_s": collected.full_s,
            "gc_full": collected.full,
        }
    )
    if cuda:
        extra["copy_gbs"] = copy_gbs
        extra.update(_step_floors(llm, stats, copy_gbs))
        extra.update(_prefill_steps(stats))
        if arm.lone_prefill:
            extra["load_bound_output_tok_s"] = load_bound(llm, load, float(extra["lone_prefill_tok_s"]), copy_gbs)
    return summarize(arm.name, results, duration, **extra), digests
