"""The scheduler: which requests run in the next step, with how many tokens each, and the KV blocks
and table rows they hold. It owns the requests' queues and the block manager; what it decides goes to
the model runner as a plain SchedulerOutput, and nothing here touches a device.

Every step, in this order:
1. Running requests, oldest first, each get their next piece: one token when decoding, else the
   next chunk of the prompt that fits the step's token budget (max_num_batched_tokens, or under an
   ITL target the tokens a step of these requests computes within it, fp8route.engine.step_cost).
   A request whose next tokens need a block the pool cannot give preempts the newest running
   request (it frees its blocks and goes back to the front of the queue, to be computed again; its
   full blocks stay in the prefix cache, so the recompute often finds them), until the pool can
   give it or it was the newest.
2. Waiting requests are admitted in arrival order while a table row, budget and blocks remain:
   the longest cached prefix of a new request is taken from the prefix cache and not computed. Under
   admission="reserve" the blocks must also hold every running request, and this one, to their
   max_tokens, so step 1 preempts only past a request admitted alone whose max_tokens outlast the pool.

A step is scheduled before the tokens of the step before it are read back (the engine overlaps the
two), so a request's positions count as computed once scheduled, and a token sampled but not yet
read counts as pending (Request.num_pending): the next decode reads it on the device. A request that
has all its output scheduled is not scheduled again; one that a token will stop is, once more, and
that step's token is dropped.
"""

from __future__ import annotations

import logging
from collections import deque

from fp8route.engine.blocks import ROOT, BlockManager, blocks_for
from fp8route.engine.config import EngineConfig
from fp8route.engine.request import Request, Status
from fp8route.engine.scheduler_output import NewRequest, ScheduledSeq, SchedulerOutput
from fp8route.engine.step_cost import StepCost

log = logging.getLogger("fp8route")


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, step_cost: StepCost | None = None) -> None:
        """A scheduler over a pool of num_blocks KV blocks, for a config the engine resolved (its
        max_model_len and max_num_batched_tokens set). Each of the max_num_seqs requests running at
        once holds a table row of its own. With config.itl_target_ms, step_cost prices a step."""
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None, "an unresolved config"
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.block_size = config.block_size
        self.max_num_seqs, self.max_model_len = config.max_num_seqs, config.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.itl_target_ms, self.step_cost = config.itl_target_ms, step_cost
        self.reserve = config.admission == "reserve"
        self.deterministic = config.deterministic
        self._warned_preemption = False  # the deterministic mode's warning, once
        assert self.itl_target_ms is None or step_cost is not None, "an ITL target needs a step cost"
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_rows = list(range(self.max_num_seqs - 1, -1, -1))
        self.preemptions = 0
        self._building: SchedulerOutput | None = None  # the step being scheduled
        self._given: dict[int, Request] = {}  # the rows it gives whole: row -> request

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = self._building = SchedulerOutput()
        singles: list[ScheduledSeq] = []
        chunks: list[ScheduledSeq] = []
        budget = self._budget()
        i = 0
        while i < len(self.running):
            request = self.running[i]
            if self._done(request):  # every output token is scheduled; it ends when they are read back
                i += 1
                continue
            n = 1 if request.remaining == 1 else min(request.remaining, budget)
            if n == 0:
                i += 1
                continue
            while not self._grow(request, n, out):
                victim = self.running[-1]
                self.preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            if request.status is not Status.RUNNING:
                break  # it was the newest, preempted for itself: nothing after it remains
            piece = self._take(request, n)
            (singles if self._decode_row(request, piece) else chunks).append(piece)
            budget -= n
            i += 1
        to_come = self._blocks_to_come(self.running) if self.reserve else 0
        while self.waiting and not out.preempted_ids and budget > 0 and len(self.running) < self.max_num_seqs:
            admitted = self._admit(self.waiting[0], budget, out, to_come)
            if admitted is None:
                break
            to_come += self._blocks_to_come([self.running[-1]]) if self.reserve else 0
            (singles if self._decode_row(self.running[-1], admitted) else chunks).append(admitted)
            budget -= admitted.num_tokens
        # Fresh chunks (their prompts' first, nothing before them cached) last: the runner attends over
        # a step's trailing fresh chunks on their own (StepAttention's fresh chunks).
        out.seqs = singles + sorted(chunks, key=lambda piece: piece.start == 0)
        out.decode_rows = len(singles) if self.deterministic else None
        out.new_requests = [_new_request(r) for r in self._given.values()]
        self._building = None
        self._given = {}
        return out

    def _decode_row(self, request: Request, piece: ScheduledSeq) -> bool:
        """Whether piece runs as a decode row: one token; in the deterministic mode also past the prompt.
        A prompt's last token alone (a chunk's remainder, or all a prefix cache left) then takes the
        path its other tokens take, and its logits do not depend on how the prompt was cut."""
        if piece.num_tokens != 1:
            return False
        return not self.deterministic or piece.start >= len(request.prompt_token_ids)

    def _budget(self) -> int:
        """This step's tokens: max_num_batched_tokens, or under an ITL target what the step cost says
        fits it, at least a token for every running request and a block's worth for a prefill chunk
        (a target no step can keep still moves every request)."""
        if self.itl_target_ms is None or self.step_cost is None:
            return self.max_num_batched_tokens
        rows = len(self.running) + bool(self.waiting)
        positions = sum(r.num_computed for r in self.running)  # what their attention reads
        fits = self.step_cost.tokens_within(self.itl_target_ms, rows, positions)
        return min(self.max_num_batched_tokens, max(fits, len(self.running) + self.block_size))

    def _done(self, request: Request) -> bool:
        return request.num_output_scheduled >= request.max_tokens or request.length >= self.max_model_len

    def _take(self, request: Request, n: int) -> ScheduledSeq:
        """Schedule n positions of request: they count as computed from now on."""
        start = request.num_computed
        samples = start + n == request.length
        request.num_computed += n
        request.num_pending += samples
        assert request.row is not None
        return ScheduledSeq(
            request.request_id, request.row, start, n, request.token_ids[start : start + n], samples,
            request.num_preemptions, request.num_output_scheduled - 1,
        )  # fmt: skip

    def _admit(self, request: Request, budget: int, out: SchedulerOutput, to_come: int) -> ScheduledSeq | None:
        """Admit the first waiting request with up to budget tokens; None if it must wait. to_come: the
        blocks the running requests will still take (reserve admission's)."""
        if not self.free_rows or request.num_pending:  # a preempted request's last token is still on its way
            return None
        # A request that scores its prompt computes every position of it: it takes nothing from the cache.
        reusable = 0 if request.params.prompt_logprobs is not None else len(request.token_ids) - 1
        cached, parent = self.blocks.match_prefix(request.token_ids, reusable)
        computed = len(cached) * self.block_size
        n = min(len(request.token_ids) - computed, budget)
        need = blocks_for(computed + n, self.block_size) - len(cached)
        if not self.reserve:  # a block for each running request to grow into, so admitting forces no preemption
            keep = len(self.running)
        elif self.running:  # what they and this request will still take, to their max_tokens
            keep = to_come + max(0, self._lifetime_blocks(request) - len(cached) - need)
        else:  # alone it runs, reaching its max_tokens or not (as on_demand admission would)
            keep = 0
        fresh = self.blocks.allocate(need) if self.blocks.free_blocks - need >= keep else None
        if fresh is None:
            self.blocks.free(cached)
            return None
        self.waiting.popleft()
        self.blocks.stats.queried_tokens += len(request.token_ids)
        self.blocks.stats.hit_tokens += computed
        request.blocks = cached + fresh
        request.num_computed = computed
        request.num_cached_blocks, request.last_key = len(cached), parent
        request.num_cached_tokens = computed
        request.row = self.free_rows.pop()
        request.status = Status.RUNNING
        self._given[request.row] = request
        self.running.append(request)
        return self._take(request, n)

    def _lifetime_blocks(self, request: Request) -> int:
        """The blocks request holds once it has written its prompt and max_tokens."""
        return blocks_for(len(request.prompt_token_ids) + request.max_tokens, self.block_size)

    def _blocks_to_come(self, requests: list[Request]) -> int:
        """The blocks requests will still take to reach their max_tokens."""
        return sum(max(0, self._lifetime_blocks(r) - len(r.blocks)) for r in requests)

    def _grow(self, request: Request, n: int, out: SchedulerOutput) -> bool:
        """Blocks for positions up to num_computed + n - 1; False if the pool is short (nothing taken)."""
        need = blocks_for(request.num_computed + n, self.block_size) - len(request.blocks)
        if need <= 0:
            return True
        fresh = self.blocks.allocate(need)
        if fresh is None:
            return False
        assert request.row is not None
        if request.row not in self._given:  # a row given whole this step lists them all
            out.new_blocks += [(request.row, len(request.blocks) + j, block) for j, block in enumerate(fresh)]
        request.blocks += fresh
        return True

    def preempt(self, request: Request) -> None:
        """Back to the front of the queue holding nothing; it is computed again when readmitted."""
        self._release(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)
        if self.deterministic and request.output_token_ids and not self._warned_preemption:
            self._warned_preemption = True
            log.warning(
                "deterministic mode: request %s was preempted (the KV pool was full); its %d output positions are "
                "computed again through the prompt's path, so its later tokens can differ from a run without "
                "preemption. Give the KV cache more memory, or lower max_num_seqs",
                request.request_id, len(request.output_token_ids),
            )  # fmt: skip

    def finish(self, request: Request, reason: str, stop_reason: int | None = None) -> None:
        if request.status is Status.WAITING:
            self.waiting.remove(request)
        elif request.status is Status.RUNNING:
            self._release(request)
        request.status = Status.FINISHED
        request.finish_reason, request.stop_reason = reason, stop_reason

    def _release(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free(request.blocks)
        assert request.row is not None
        out = self._building
        if out is not None:  # preempted while this step is scheduled: write nothing for its row
            self._given.pop(request.row, None)
            out.new_blocks = [e for e in out.new_blocks if e[0] != request.row]
        self.free_rows.append(request.row)
        request.row = None
        request.blocks = []
        request.num_computed = 0
        request.num_cached_blocks, request.last_key = 0, ROOT

    def computed(self, request: Request, piece: ScheduledSeq) -> None:
        """A step's piece of request has run and its tokens are read back: register the blocks it
        filled whose tokens are all known in the prefix cache."""
        if request.status is not Status.RUNNING or request.num_preemptions != piece.generation:
            return
        filled = min(piece.start + piece.num_tokens, len(request.token_ids))
        if self.deterministic:
            # Only prompt positions, which every request computes through the prompt's path: an output's
            # position was computed as a decode row, and a later prompt repeating it must not read those bits.
            filled = min(filled, len(request.prompt_token_ids))
        size = self.block_size
        while (request.num_cached_blocks + 1) * size <= filled:
            index = request.num_cached_blocks
            tokens = request.token_ids[index * size : (index + 1) * size]
            request.last_key = self.blocks.cache_full_block(request.blocks[index], request.last_key, tokens)
            request.num_cached_blocks += 1


def _new_request(request: Request) -> NewRequest:
    """What the runner keeps of a request given a row: copies, as the request's lists grow on."""
    assert request.row is not None
    return NewRequest(
        request.request_id, request.row, request.params, request.seed, tuple(request.prompt_token_ids),
        tuple(request.output_token_ids), tuple(request.blocks),
    )  # fmt: skip
