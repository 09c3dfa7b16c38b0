"""LLMEngine: requests in, one scheduled step at a time, tokens out.

A step is one forward (fp8route.engine.runner): every running decode and every prefill chunk that
fits the token budget. With async scheduling (the default on a GPU) the engine schedules and
launches step N+1 before it reads back step N's tokens, so the host's work for one step (scheduling,
inputs, bookkeeping, detokenizing downstream) runs while the GPU computes the other, whatever the
mix of requests. What makes that safe:
- a decode's input token is the one its row sampled last, read on the device;
- a request whose output is fully scheduled is not scheduled again, and one that a token stops (EOS,
  a stop id) may run one step more, whose token is dropped;
- blocks a request frees may be taken by a later step only, which runs after every step before it.
Without it (on a CPU, where nothing would overlap) each step's tokens are read back at once.
"""

from __future__ import annotations

import atexit
import functools
import gc
import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from fp8route.engine.blocks import BlockManager, blocks_for
from fp8route.engine.config import EngineConfig
from fp8route.engine.flashinfer_attention import check_attention
from fp8route.engine.kv_pool import KVCacheSpec
from fp8route.engine.kv_quant import KVScales
from fp8route.engine.load import load_weights
from fp8route.engine.request import Request, RequestMetrics, Status, TokenLogprobs
from fp8route.engine.runner import Forward, InFlight, ModelRunner, StepResult
from fp8route.engine.sampling import SamplingParams
from fp8route.engine.scheduler import Scheduler
from fp8route.engine.scheduler_output import SchedulerOutput
from fp8route.engine.structured import Grammars
from fp8route.errors import Fp8InputError
from fp8route.linear.layer import Fp8Linear
from fp8route.linear.policy import Policy
from fp8route.models.llama import FloatLinear, LlamaConfig, LlamaForCausalLM

DEFAULT_CONTEXT = 8192  # for a config without max_position_embeddings


@functools.cache
def freeze_startup_heap() -> None:
    """Once per process, before its first engine loads: what the process holds by then (the imported
    libraries, most of its objects) is put out of the cyclic garbage collector's reach, so a full
    collection under load walks what serving allocated, not the libraries (docs/engine.md: the pause
    it removes). Only once: an engine still referenced when a later one loads would, frozen, never be
    collected from its reference cycles. Unfrozen at exit, so the last collection reaches them again
    (without it Triton's bindings report their objects as leaked when Python shuts down)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


@dataclass
class StepStats:
    """One step, for benchmarks: what ran, and where its time went (host clock, seconds)."""

    decodes: int  # one-token pieces
    prefill_tokens: int  # the chunks' tokens
    decode_context: int  # positions the decodes attend to, summed: the KV they read
    used_blocks: int  # the pool's blocks in use when the step was launched
    host_s: float  # its scheduling, inputs and launches, and its bookkeeping once read back
    wall_s: float  # from the step before it being read back to itself being read back


@dataclass
class Update:
    """What one step did for one request: the tokens it gained (0 or 1) with their log-probabilities
    when it asked for them, and whether it ended."""

    request: Request
    new_token_ids: list[int]
    finished: bool
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class _Launched:
    """A step launched and not read back: the runner's handle on it, the requests it ran by id (as the
    engine held them when it was scheduled: an id may be reused once its request ends), its accounting."""

    step: InFlight
    requests: dict[str, Request]
    stats: StepStats | None = None


@dataclass(frozen=True)
class EngineLimits:
    """What decides whether a request can ever run: enough to check it where the engine is not."""

    vocab_size: int
    max_model_len: int
    block_size: int
    usable_blocks: int
    capacity_tokens: int
    eos_token_ids: tuple[int, ...] = ()


def check_prompt(
    ids: Sequence[int], params: SamplingParams, limits: EngineLimits, grammars: Grammars | None = None
) -> None:
    """Raise Fp8InputError unless these prompt ids with these params can ever run within limits (and
    their structured output compiles with grammars)."""
    if not ids:
        raise Fp8InputError("the prompt is empty: give at least one token")
    vocab = limits.vocab_size
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
    if bad:
        raise Fp8InputError(f"prompt token ids must be integers in 0..{vocab - 1} (the vocabulary), got {bad[0]!r}")
    biased = [t for t in params.logit_bias or () if t >= vocab]
    if biased:
        raise Fp8InputError(f"logit_bias names token {biased[0]}, past the vocabulary (0..{vocab - 1})")
    if params.structured_outputs is not None:
        if grammars is None:
            raise Fp8InputError("structured output needs the model's tokenizer, which this engine was started without")
        grammars.compile(params.structured_outputs)
    wanted = len(ids) + (params.max_tokens or 1)
    if wanted > limits.max_model_len:
        raise Fp8InputError(
            f"a prompt of {len(ids)} tokens + max_tokens={params.max_tokens} = {wanted} exceeds the model's "
            f"context of {limits.max_model_len} tokens; shorten the prompt or lower max_tokens"
        )
    need = blocks_for(wanted, limits.block_size)
    if need > limits.usable_blocks:
        raise Fp8InputError(
            f"a prompt of {len(ids)} tokens + max_tokens={params.max_tokens} needs {need} KV blocks but the "
            f"pool has {limits.usable_blocks} ({limits.capacity_tokens} tokens); lower max_tokens or give the "
            "engine a larger KV cache (num_kv_blocks, or gpu_memory_utilization on a GPU)"
        )


def sample_id(request_id: str, index: int, n: int) -> str:
    """The engine's id of sample `index` of a request of n samples (vLLM's naming)."""
    return request_id if n == 1 else f"{index}_{request_id}"


def check_batch_invariant(model: LlamaForCausalLM) -> None:
    """Refuse a model whose linears were not made for the deterministic mode (planned without it, or
    float linears outside row tiles): an engine over it would not keep its promise."""
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            ok, how = module.plan.batch_invariant, f"its plan: {module.plan.invariance_text()}"
        elif isinstance(module, FloatLinear):
            ok, how = module.batch_invariant, "a float linear built without batch_invariant"
        else:
            continue
        if not ok:
            raise Fp8InputError(
                f"deterministic=True: layer {name} was not made for it ({how}); load the model with the same "
                "config (load_weights(path, config), or LLMEngine.from_config)"
            )


def model_context(cfg: LlamaConfig) -> int:
    """The longest prompt plus output the model takes: its max_position_embeddings."""
    return cfg.max_position_embeddings or DEFAULT_CONTEXT


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        *,
        device: torch.device | None = None,
        kv_scales: KVScales | None = None,
        eos_token_ids: Sequence[int] = (),
        parallel: str | None = None,
        quiet: bool = False,
    ) -> None:
        """An engine over a plain model (on device, its tensors' by default): the runner, which sizes
        its KV pool from what memory is left and captures its graphs, then the scheduler over that
        pool. parallel: how this rank shares the model, when it is sharded."""
        device = device or model.model.embed_tokens.weight.device
        check_attention(config.attention, device)
        self.config = config = config.resolved(device, model_context(model.cfg))
        if config.deterministic:
            config.check_deterministic()
            check_batch_invariant(model)
        self.model, self.device, self.parallel = model, device, parallel
        self.runner = ModelRunner(config, model, device=device, kv_scales=kv_scales, eos_token_ids=eos_token_ids)
        self.scheduler = Scheduler(config, self.runner.initialize(quiet), self.runner.step_cost)
        self.async_scheduling = bool(config.async_scheduling)
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[Request]] = {}  # a request of n > 1 samples: its samples
        self._held: dict[str, list[Request]] = {}  # samples that wait for the first one's prompt
        self.grammar_source: Callable[[], Grammars] | None = None  # makes the grammars on first use
        self._grammars: Grammars | None = None
        self._ids = itertools.count()
        self._seeds = random.Random(0)
        self.record_stats = config.record_stats
        self.stats: list[StepStats] = []
        self.ahead_steps = 0  # steps launched before the step before them was read back
        self._inflight: _Launched | None = None
        self._read_at = 0.0  # when the last step was read back

    @classmethod
    def from_config(cls, config: EngineConfig, policy: Policy | None = None, quiet: bool = False) -> LLMEngine:
        """An engine over the checkpoint config.model names (fp8route.engine.load.load_weights), its
        FP8 layers planned by policy."""
        freeze_startup_heap()
        loaded = load_weights(config.model, config, policy)
        if loaded.device.type == "cpu":
            config.use_cpu_threads()
        return cls(
            config, loaded.model, device=loaded.device, kv_scales=loaded.kv_scales,
            eos_token_ids=loaded.eos_token_ids, parallel=loaded.parallel, quiet=quiet,
        )  # fmt: skip

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus output a request may have."""
        assert self.config.max_model_len is not None
        return self.config.max_model_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a request (unless it ignores EOS); the sampler holds them back before min_tokens."""
        return self.runner.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Sequence[int]) -> None:
        self.runner.eos_token_ids = tuple(ids)

    @property
    def kv_cache(self) -> KVCacheSpec:
        """The KV pool the runner sized."""
        return self.runner.pool.spec

    @property
    def blocks(self) -> BlockManager:
        return self.scheduler.blocks

    @property
    def limits(self) -> EngineLimits:
        pool = self.runner.pool
        return EngineLimits(
            self.model.cfg.vocab_size, self.max_model_len, pool.block_size, self.blocks.usable_blocks,
            pool.capacity_tokens, self.eos_token_ids,
        )  # fmt: skip

    @property
    def grammars(self) -> Grammars | None:
        """What compiles and runs structured output (None: no tokenizer to build it from)."""
        if self._grammars is None and self.grammar_source is not None:
            self._grammars = self.grammar_source()
        return self._grammars

    def check_prompt(self, ids: Sequence[int], params: SamplingParams) -> None:
        """Raise Fp8InputError unless these prompt ids with these params can ever run here."""
        check_prompt(ids, params, self.limits, self.grammars if params.structured_outputs is not None else None)

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Queue a request; anything that could never run is refused here, before any work."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise Fp8InputError(f"expected SamplingParams, got {type(params).__name__}")
        ids = list(prompt_token_ids)
        self.check_prompt(ids, params)
        max_tokens = self.max_model_len - len(ids) if params.max_tokens is None else params.max_tokens
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests or request_id in self.groups:
            raise Fp8InputError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        samples = [self._sample(request_id, i, ids, params, seed, arrival, prompt, max_tokens) for i in range(params.n)]
        for request in samples:
            self.requests[request.request_id] = request
        first, rest = samples[0], samples[1:]
        self.scheduler.add(first)
        if rest:
            self.groups[request_id] = samples
            if self.config.enable_prefix_caching:  # the others wait to find the first's prompt in the cache
                self._held[first.request_id] = rest
            else:
                for request in rest:
                    self.scheduler.add(request)
        return first

    def _sample(
        self, group: str, index: int, ids: list[int], params: SamplingParams, seed: int, arrival: float,
        prompt: str | None, max_tokens: int,
    ) -> Request:  # fmt: skip
        """Sample `index` of a request: one sample of its own, seeded seed + index; only the first
        scores the prompt."""
        request_id = sample_id(group, index, params.n)
        if params.n > 1:
            params = replace(params, n=1, prompt_logprobs=params.prompt_logprobs if index == 0 else None)
        spec = params.structured_outputs
        grammars = self.grammars if spec is not None else None
        return Request(
            request_id, list(ids), params, seed + index, RequestMetrics(arrival), prompt=prompt,
            max_tokens=max_tokens, group_id=group, index=index,
            matcher=grammars.matcher(spec) if grammars is not None and spec is not None else None,
        )  # fmt: skip

    def samples(self, request: Request) -> list[Request]:
        """Every sample of the request `request` is the first of (itself when n is 1)."""
        return self.groups.get(request.group_id, [request])

    def abort(self, request_id: str) -> bool:
        """Stop a request (every sample of it) now and free its blocks (a step in flight still writing
        them runs before any step that takes them); False if it is unknown or already finished."""
        group = self.groups.pop(request_id, None)
        samples = group if group is not None else [self.requests.get(request_id)]
        aborted = False
        for request in samples:
            if request is None or request.finished:
                continue
            self.requests.pop(request.request_id, None)
            self._release_held(request)  # its siblings need not wait for a prompt that will not come
            held = next((rest for rest in self._held.values() if request in rest), None)
            if held is not None:  # it never reached the scheduler
                held.remove(request)
                request.status, request.finish_reason = Status.FINISHED, "abort"
            else:
                self.scheduler.finish(request, "abort")
            request.metrics.finished_time = time.monotonic()
            self._forget(request)  # a sample aborted alone, its group's last: the group goes too
            aborted = True
        return aborted

    def _release_held(self, request: Request) -> None:
        for sibling in self._held.pop(request.request_id, []):
            self.scheduler.add(sibling)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._inflight or self._held)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self) -> list[Update]:
        """Schedule and launch the next step; read back the step before it (async scheduling) or this
        one. Returns what the steps read back did for each request they ran."""
        start = time.perf_counter()
        if self._inflight is None:  # nothing launched before this call: the step read back is timed from here
            self._read_at = start
        out = self.scheduler.schedule()
        updates: list[Update] = []
        launched = None
        if not out.empty:
            owners = {r.request_id: r for r in self.scheduler.running}
            now = time.monotonic()
            for piece in out.seqs:
                metrics = owners[piece.request_id].metrics
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = now
            forward = self.runner.forward(out)
            masks = self._masks(forward, owners, updates) if forward.constrained else None
            launched = _Launched(self.runner.sample(forward, masks), owners)
        if launched is not None and self.record_stats:
            launched.stats = self._record(out, time.perf_counter() - start)
            self.stats.append(launched.stats)
        previous, self._inflight = self._inflight, launched
        if previous is not None:
            self.ahead_steps += launched is not None
        elif not self.async_scheduling or launched is None:
            previous, self._inflight = launched, None
        if previous is not None:
            updates += self._read_back(previous)
        return updates

    def _read_back(self, launched: _Launched) -> list[Update]:
        result = launched.step.read()
        read = time.perf_counter()
        updates = self._advance(launched, result)
        if launched.stats is not None:
            # A step's wall time is from the step before it being read back to itself being read back:
            # with async scheduling, the host's work for the next step is inside it.
            launched.stats.host_s += time.perf_counter() - read
            launched.stats.wall_s = read - self._read_at
        self._read_at = read
        return updates

    def _masks(self, forward: Forward, owners: dict[str, Request], updates: list[Update]) -> torch.Tensor:
        """The constrained rows' bitmasks, on the host: a row whose request ended allows every token
        (its token is dropped), one past its grammar's end its stop tokens only. A grammar's mask needs
        every token before this step's: the step in flight is read back first (into updates), while
        this step's forward is queued behind it."""
        if self._inflight is not None:
            updates += self._read_back(self._inflight)
            self._inflight = None
        grammars = self.grammars
        assert grammars is not None, "a constrained request came in without grammars"
        requests = [owners[forward.sampling[i].request_id] for i in forward.constrained]
        masks = grammars.new_bitmask(len(requests))
        grammars.fill(masks, [None if r.finished else r.matcher for r in requests])
        return masks

    def drain(self) -> list[Update]:
        """Read back the step in flight, if any (after aborts, before the engine is let go)."""
        launched, self._inflight = self._inflight, None
        if launched is None:
            return []
        return self._advance(launched, launched.step.read())

    def _record(self, out: SchedulerOutput, host_s: float) -> StepStats:
        seqs, singles = out.seqs, out.singles
        return StepStats(
            singles, sum(s.num_tokens for s in seqs[singles:]), sum(s.start + 1 for s in seqs[:singles]),
            self.blocks.used_blocks, host_s, 0.0,
        )  # fmt: skip

    def _advance(self, launched: _Launched, result: StepResult) -> list[Update]:
        """Register what a step read back computed and append its tokens; a request that ended after
        the step was launched (a token stopped it, or an abort) gets nothing from it."""
        scheduler, owners, step = self.scheduler, launched.requests, launched.step
        updates: dict[str, Update] = {}
        for piece in step.out.seqs:
            request = owners[piece.request_id]
            scheduler.computed(request, piece)
            if piece.samples:  # its prompt is computed: samples waiting for it find it in the cache
                self._release_held(request)
            if request.status is not Status.FINISHED:
                updates.setdefault(piece.request_id, Update(request, [], False))
        for request_id, position, prompt_entry in result.prompt_logprobs:
            request = owners[request_id]
            if request.prompt_logprobs is not None:
                request.prompt_logprobs[position] = prompt_entry
        now = time.monotonic()
        for i, (piece, token) in enumerate(zip(step.sampling, result.tokens, strict=True)):
            request = owners[piece.request_id]
            request.num_pending -= 1
            if request.status is Status.FINISHED:
                continue
            request.token_ids.append(token)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            update = updates[piece.request_id]
            update.new_token_ids.append(token)
            entry = result.logprobs.get(i)
            if entry is not None and request.logprobs is not None:
                request.logprobs.append(entry)
                update.new_logprobs.append(entry)
            if request.matcher is not None:
                request.matcher.accept(token)
            reason, stop = self._stop(request, token)
            if reason is not None:
                scheduler.finish(request, reason, stop)
                request.metrics.finished_time = now
                update.finished = True
                self._forget(request)
        return list(updates.values())

    def _forget(self, request: Request) -> None:
        """A finished request leaves the engine's books (its group with its last sample)."""
        self.requests.pop(request.request_id, None)
        group = self.groups.get(request.group_id)
        if group is not None and all(r.finished for r in group):
            del self.groups[request.group_id]

    def _stop(self, request: Request, token: int) -> tuple[str | None, int | None]:
        params = request.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", token
        if request.matcher is not None and request.matcher.terminated and not params.ignore_eos:
            return "stop", None
        if request.num_output_tokens >= request.max_tokens or len(request.token_ids) >= self.max_model_len:
            return "length", None
        return None, None

    def leaked(self) -> str | None:
        """None when nothing is running or waiting and every block is back in the pool."""
        if self.has_unfinished:
            return f"{self.num_running} running and {self.num_waiting} waiting requests"
        return self.blocks.check_empty()


__all__ = ["LLMEngine", "Status", "StepStats", "Update", "sample_id"]
