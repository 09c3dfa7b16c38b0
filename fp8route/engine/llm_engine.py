"""LLMEngine: requests in, one scheduled step at a time, tokens out.

A step is the scheduler's plan run as at most two forwards: the prefill chunks packed into one
eager forward, and every decoding request's next token from the CUDA graph of the batch's bucket.
With mixed_steps the decodes instead ride at the chunks' end (one token a row, their attention one
paged decode call per layer): one forward's weight reads, not two, but eager. The tokens
chosen are copied to the host as soon as they are launched: one wait per step, which the
bookkeeping that follows (appending tokens, stop checks, new blocks) needs anyway.

With async_scheduling (the default on a GPU), a decode-only step launches the next one before
waiting for its own tokens: the next step's input tokens are this step's, still on the device, so
the GPU runs the next step while the host reads this one's tokens back and does its bookkeeping.
It does so only when the next step's plan is known without those tokens: every running request
decodes again (none ends by length, none can be admitted in its place), all greedy past
min_tokens, and the pool gives each its next block. A request that a token stops (EOS, a stop id)
had one more position computed, whose token is dropped; the blocks it wrote are freed after, in
stream order. Not with FlashInfer's attention: its decode plan reaches the GPU through a host
buffer of its own that the next step's plan would overwrite before the copy has run.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fp8route.engine.argmax import greedy_tokens
from fp8route.engine.causal_lm import CausalLM
from fp8route.engine.inflight import InFlight
from fp8route.engine.kv_pool import blocks_for, upload
from fp8route.engine.request import Request, RequestMetrics, Status
from fp8route.engine.runner import DecodeRows
from fp8route.engine.sampling import SamplingParams, mask_tokens, sample
from fp8route.engine.scheduler import Scheduler, Step
from fp8route.errors import Fp8InputError

ASYNC_WITH_FLASHINFER = (
    "async_scheduling does not run with attention='flashinfer' (FlashInfer plans each decode step through a host "
    "buffer the next step's plan would overwrite before the GPU has read it): use the builtin attention with it"
)


@dataclass
class StepStats:
    """One step, for benchmarks: what ran, and where its time went (host clock, seconds)."""

    decodes: int
    prefill_tokens: int
    mixed: bool  # the decodes rode in the prefill chunks' forward: not a decode graph's step
    decode_context: int  # positions the decodes attend to, summed: the KV they read
    used_blocks: int  # the pool's blocks in use during the step
    host_s: float  # the step's own Python work: scheduling, inputs, launches, bookkeeping
    wall_s: float  # the whole step, the wait for the GPU included


@dataclass
class Update:
    """What one step did for one request: the tokens it gained (0 or 1), and whether it ended."""

    request: Request
    new_token_ids: list[int]
    finished: bool


@dataclass(frozen=True)
class EngineLimits:
    """What decides whether a request can ever run: enough to check it where the engine is not."""

    vocab_size: int
    max_model_len: int
    block_size: int
    usable_blocks: int
    capacity_tokens: int


def check_prompt(ids: Sequence[int], params: SamplingParams, limits: EngineLimits) -> None:
    """Raise Fp8InputError unless these prompt ids with these params can ever run within limits."""
    if not ids:
        raise Fp8InputError("the prompt is empty: give at least one token")
    vocab = limits.vocab_size
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
    if bad:
        raise Fp8InputError(f"prompt token ids must be integers in 0..{vocab - 1} (the vocabulary), got {bad[0]!r}")
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
            "engine more memory (gpu_memory_utilization)"
        )


class LLMEngine:
    def __init__(
        self,
        model: CausalLM,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: Sequence[int] = (),
        record_stats: bool = False,
        mixed_steps: bool = False,
        async_scheduling: bool | None = None,
    ) -> None:
        """async_scheduling None: on a GPU, unless the attention is FlashInfer's (its decode plans go
        through a host buffer); off on a CPU, where nothing would overlap."""
        if max_num_seqs < 1 or max_num_seqs > model.max_batch_size:
            raise Fp8InputError(
                f"max_num_seqs must be in 1..{model.max_batch_size} (the model's table rows), got {max_num_seqs}"
            )
        if async_scheduling and model.runner.plans_on_host:
            raise Fp8InputError(ASYNC_WITH_FLASHINFER)
        if max_num_batched_tokens < max_num_seqs:
            raise Fp8InputError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_num_seqs ({max_num_seqs}): "
                "every running request takes a token of each step's budget"
            )
        self.model = model
        self.max_model_len = model.max_seq_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.scheduler = Scheduler(model.blocks, model.pool, max_num_seqs, max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seeds = random.Random(0)
        self.record_stats = record_stats
        # Whether a step with prefill chunks and decodes runs them as one forward (the decodes at
        # the chunks' end) or as two (the chunks, then the decode graph); off: two same-run A/Bs
        # measured 1.05x and 0.96x (benchmarks/results/h200/serve/COMMAND.md, runs 7a and 7b).
        self.mixed_steps = mixed_steps
        if async_scheduling is None:
            async_scheduling = model.device.type == "cuda" and not model.runner.plans_on_host
        self.async_scheduling = async_scheduling
        self.ahead_steps = 0  # decode steps launched before the step before them was read back
        self._ahead: InFlight | None = None
        self.stats: list[StepStats] = []

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
        limit = self.max_model_len - len(ids)
        max_tokens = limit if params.max_tokens is None else params.max_tokens
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise Fp8InputError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        metrics = RequestMetrics(arrival_time if arrival_time is not None else time.monotonic())
        request = Request(request_id, ids, params, seed, metrics, prompt=prompt, max_tokens=max_tokens)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    @property
    def limits(self) -> EngineLimits:
        blocks, pool = self.model.blocks, self.model.pool
        return EngineLimits(
            self.model.cfg.vocab_size, self.max_model_len, pool.block_size, blocks.usable_blocks, pool.capacity_tokens
        )

    def check_prompt(self, ids: Sequence[int], params: SamplingParams) -> None:
        """Raise Fp8InputError unless these prompt ids with these params can ever run here."""
        check_prompt(ids, params, self.limits)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already finished."""
        request = self.requests.pop(request_id, None)
        if request is None or request.finished:
            return False
        self.scheduler.finish(request, "abort")
        request.metrics.finished_time = time.monotonic()
        return True

    @property
    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self) -> list[Update]:
        """Schedule and run one step (or take the one launched ahead); returns what it did for each
        request it ran."""
        start = time.perf_counter()
        launched, self._ahead = self._ahead, None
        if launched is not None and not any(r.status is Status.RUNNING for r in launched.plan.decodes):
            launched = None  # every request it ran ended (or was aborted) after it was launched
        if launched is None:
            plan = self.scheduler.schedule()
            if plan.empty:
                return []
            self.scheduler.flush_tables()
            now = time.monotonic()
            for request, _ in plan.prefills:
                if request.metrics.first_scheduled_time is None:
                    request.metrics.first_scheduled_time = now
            launched = InFlight.start(plan, *self._run(plan), copy=self.async_scheduling)
        plan = launched.plan
        decodes = [r for r in plan.decodes if r.status is Status.RUNNING]
        if self.record_stats:  # read before finished requests let their blocks go, or a step ahead takes more
            used = self.model.blocks.used_blocks
            context = sum(r.num_computed + 1 for r in decodes)
        if self.async_scheduling:
            self._ahead = self._launch_ahead(launched)
        waited = time.perf_counter()
        tokens = launched.tokens()
        synced = time.perf_counter()
        updates = self._advance(plan, decodes, launched.sampling, tokens)
        if self.record_stats:
            end = time.perf_counter()
            self.stats.append(
                StepStats(
                    len(decodes),
                    sum(n for _, n in plan.prefills),
                    bool(self.mixed_steps and plan.decodes and plan.prefills),
                    context,
                    used,
                    (waited - start) + (end - synced),
                    end - start,
                )  # fmt: skip
            )
        return updates

    def _launch_ahead(self, current: InFlight) -> InFlight | None:
        """The decode step after `current`, launched now with current's tokens as its inputs (still
        on the device), when its plan does not depend on their values; else None."""
        plan, scheduler = current.plan, self.scheduler
        if plan.prefills or current.sampled is None:
            return None
        keep = [i for i, r in enumerate(plan.decodes) if r.status is Status.RUNNING]
        batch = [plan.decodes[i] for i in keep]
        # After current, a request has one more output token (not yet appended) and one more computed.
        ends = [r.num_output_tokens + 1 >= r.max_tokens or len(r.token_ids) + 1 >= self.max_model_len for r in batch]
        admits = scheduler.waiting and (len(scheduler.running) < scheduler.max_num_seqs or any(ends))
        if admits or len(batch) != len(scheduler.running):
            return None
        batch = [r for r, end in zip(batch, ends, strict=True) if not end]
        keep = [i for i, end in zip(keep, ends, strict=True) if not end]
        if not batch or not all(r.params.greedy and r.num_output_tokens + 1 >= r.params.min_tokens for r in batch):
            return None
        if not all(scheduler.grow(r, 2) for r in batch):  # the blocks for the position after current's
            return None
        scheduler.flush_tables()
        device = self.model.device
        tokens = (
            current.sampled if len(keep) == len(plan.decodes) else current.sampled[upload(torch.tensor(keep), device)]
        )
        positions, rows = upload(torch.tensor([[r.num_computed + 1 for r in batch], [r.row for r in batch]]), device)
        _, greedy = self.model.runner.decode(tokens, positions, rows, limit=max(r.num_computed for r in batch) + 2)
        self.ahead_steps += 1
        return InFlight.start(Step(decodes=batch), greedy, batch, copy=True)

    def _run(self, plan: Step) -> tuple[torch.Tensor | None, list[Request]]:
        """Launch the step's forward and sampling; (the chosen tokens on the device, whom they are for)."""
        greedy: torch.Tensor | None
        if not plan.prefills:
            logits, greedy, sampling = self._decode(plan.decodes)
        elif self.mixed_steps or not plan.decodes:
            logits, greedy, sampling = self._packed(plan, plan.decodes)
        else:
            chunk_logits, _, sampling = self._packed(plan, [])
            decode_logits, _, decoded = self._decode(plan.decodes)
            logits, greedy, sampling = torch.cat([chunk_logits, decode_logits]), None, sampling + decoded
        if not sampling:
            return None, []
        masked = [i for i, r in enumerate(sampling) if r.num_output_tokens < r.params.min_tokens]
        if all(r.params.greedy for r in sampling) and not masked:
            return greedy_tokens(logits) if greedy is None else greedy, sampling
        if masked:
            logits = mask_tokens(logits, masked, [self._banned(sampling[i]) for i in masked])
        params = [r.params for r in sampling]
        chosen = sample(
            logits, [p.temperature for p in params], [p.top_p for p in params], [r.seed for r in sampling],
            [r.num_output_tokens for r in sampling],
        )  # fmt: skip
        return chosen, sampling

    def _packed(self, plan: Step, batch: list[Request]) -> tuple[torch.Tensor, None, list[Request]]:
        """The prefill chunks in one packed forward, the decodes of batch riding at its end: (logits,
        no argmax yet, whom each row is for: the chunks that end their prompts, then the decodes)."""
        chunks = [(r, r.token_ids[r.num_computed : r.num_computed + n]) for r, n in plan.prefills]
        wanted = [i for i, (r, n) in enumerate(plan.prefills) if r.num_computed + n == len(r.token_ids)]
        tail = None
        if batch:
            tail = DecodeRows(
                [r.token_ids[-1] for r in batch], [r.num_computed for r in batch],
                [r.row for r in batch], [r.blocks for r in batch],  # type: ignore[misc]
            )  # fmt: skip
        logits = self.model.runner.prefill(
            [t for _, t in chunks], [r.num_computed for r, _ in chunks], [r.row for r, _ in chunks],  # type: ignore[misc]
            [r.blocks for r, _ in chunks], wanted, tail,
        )  # fmt: skip
        return logits, None, [plan.prefills[i][0] for i in wanted] + batch

    def _decode(self, batch: list[Request]) -> tuple[torch.Tensor, torch.Tensor, list[Request]]:
        """Every decoding request's next token, from the CUDA graph of the batch's bucket on a GPU:
        (logits, their argmax, whom each row is for)."""
        runner = self.model.runner
        packed = torch.tensor(
            [[r.token_ids[-1] for r in batch], [r.num_computed for r in batch], [r.row for r in batch]],
            dtype=torch.int64,
        )
        tokens, positions, rows = upload(packed, self.model.device)
        host_lengths = [r.num_computed + 1 for r in batch] if runner.plans_on_host else None
        host_blocks = [r.blocks for r in batch] if runner.plans_on_host else None
        logits, greedy = runner.decode(
            tokens, positions, rows, limit=max(r.num_computed for r in batch) + 1,
            host_lengths=host_lengths, host_blocks=host_blocks,
        )  # fmt: skip
        return logits, greedy, batch

    def _banned(self, request: Request) -> list[int]:
        """Ids that may not come before min_tokens: the stop ids, and EOS unless it is ignored."""
        eos = () if request.params.ignore_eos else self.eos_token_ids
        return [*eos, *request.params.stop_token_ids]

    def _advance(self, plan: Step, decodes: list[Request], sampling: list[Request], tokens: list[int]) -> list[Update]:
        """Register what the step computed and append its tokens. decodes: plan's still running; a
        request that ended after the step was launched ahead (a token stopped it, or an abort) gets
        nothing from it."""
        scheduler = self.scheduler
        for request in decodes:
            scheduler.computed(request, 1)
        for request, n in plan.prefills:
            scheduler.computed(request, n)
        updates = {id(r): Update(r, [], False) for r in decodes}
        updates.update({id(r): Update(r, [], False) for r, _ in plan.prefills})
        now = time.monotonic()
        for request, token in zip(sampling, tokens, strict=True):
            if id(request) not in updates:
                continue
            request.token_ids.append(token)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            updates[id(request)].new_token_ids.append(token)
            reason, stop = self._stop(request, token)
            if reason is not None:
                scheduler.finish(request, reason, stop)
                request.metrics.finished_time = now
                updates[id(request)].finished = True
                self.requests.pop(request.request_id, None)
        return list(updates.values())

    def _stop(self, request: Request, token: int) -> tuple[str | None, int | None]:
        params = request.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", token
        if request.num_output_tokens >= request.max_tokens or len(request.token_ids) >= self.max_model_len:
            return "length", None
        return None, None

    def leaked(self) -> str | None:
        """None when nothing is running or waiting and every block is back in the pool."""
        if self.has_unfinished:
            return f"{self.num_running} running and {self.num_waiting} waiting requests"
        return self.model.blocks.check_empty()


__all__ = ["LLMEngine", "Status", "StepStats", "Update"]
