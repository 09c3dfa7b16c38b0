"""The scheduler: which requests run in the next step, and with how many tokens each.

Every step, in this order:
1. Running requests, oldest first, each get their next piece: one token when decoding, else the
   next chunk of the prompt that fits the step's token budget. A request whose next tokens need a
   block the pool cannot give preempts the newest running request (it frees its blocks and goes
   back to the front of the queue, to be computed again; its full blocks stay in the prefix
   cache, so the recompute often finds them), until the pool can give it or it was the newest.
2. Waiting requests are admitted in arrival order while a table row, budget and blocks remain:
   the longest cached prefix of a new request is taken from the prefix cache and not computed.
Nothing here touches the GPU: the tables the step needs are written by flush_tables.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fp8route.engine.blocks import ROOT, BlockManager
from fp8route.engine.kv_pool import KVPool, blocks_for
from fp8route.engine.request import Request, Status


@dataclass
class Step:
    decodes: list[Request] = field(default_factory=list)  # one token each
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens this step)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, blocks: BlockManager, pool: KVPool, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks, self.pool = blocks, pool
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.block_size = pool.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_rows = list(range(pool.max_rows - 1, -1, -1))
        self._new_rows: dict[int, list[int]] = {}  # row -> whole table, for requests admitted this step
        self._entries: tuple[list[int], list[int], list[int]] = ([], [], [])  # (row, column, block) grown
        self.preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> Step:
        step = Step()
        budget = self.budget
        i = 0
        while i < len(self.running):
            request = self.running[i]
            n = 1 if request.remaining == 1 else min(request.remaining, budget)
            if n == 0:
                i += 1
                continue
            while not self.grow(request, n):
                victim = self.running[-1]
                self.preempt(victim)
                step.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not Status.RUNNING:
                break  # it was the newest, preempted for itself: nothing after it remains
            self._schedule(step, request, n)
            budget -= n
            i += 1
        while self.waiting and not step.preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            taken = self._admit(self.waiting[0], budget, step)
            if not taken:
                break
            budget -= taken
        return step

    def _schedule(self, step: Step, request: Request, n: int) -> None:
        if request.remaining == 1:
            step.decodes.append(request)
        else:
            step.prefills.append((request, n))

    def _admit(self, request: Request, budget: int, step: Step) -> int:
        """Admit the first waiting request with up to budget tokens: the tokens scheduled, 0 if it must wait."""
        if not self.free_rows:
            return 0
        cached, parent = self.blocks.match_prefix(request.token_ids, len(request.token_ids) - 1)
        computed = len(cached) * self.block_size
        n = min(len(request.token_ids) - computed, budget)
        need = blocks_for(computed + n, self.block_size) - len(cached)
        # Keep a block for each running request to grow into, so admitting does not force preemption.
        fresh = self.blocks.allocate(need) if self.blocks.free_blocks - need >= len(self.running) else None
        if fresh is None:
            self.blocks.free(cached)
            return 0
        self.waiting.popleft()
        self.blocks.stats.queried_tokens += len(request.token_ids)
        self.blocks.stats.hit_tokens += computed
        request.blocks = cached + fresh
        request.num_computed = computed
        request.num_cached_blocks, request.last_key = len(cached), parent
        request.num_cached_tokens = computed
        request.row = self.free_rows.pop()
        request.status = Status.RUNNING
        self._new_rows[request.row] = request.blocks
        self.running.append(request)
        self._schedule(step, request, n)
        return n

    def grow(self, request: Request, n: int) -> bool:
        """Blocks for positions up to num_computed + n - 1; False (nothing taken) if the pool is short."""
        need = blocks_for(request.num_computed + n, self.block_size) - len(request.blocks)
        if need <= 0:
            return True
        fresh = self.blocks.allocate(need)
        if fresh is None:
            return False
        assert request.row is not None
        rows, columns, blocks = self._entries
        for j, block in enumerate(fresh):
            rows.append(request.row)
            columns.append(len(request.blocks) + j)
            blocks.append(block)
        request.blocks += fresh
        return True

    def flush_tables(self) -> None:
        """Write this step's new and grown block tables to the device (before the step runs)."""
        if self._new_rows:
            self.pool.set_rows(list(self._new_rows), list(self._new_rows.values()))
            self._new_rows = {}
        rows, columns, blocks = self._entries
        if rows:
            self.pool.set_entries(rows, columns, blocks)
            self._entries = ([], [], [])

    def preempt(self, request: Request) -> None:
        """Back to the front of the queue holding nothing; it is computed again when readmitted."""
        self._release(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

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
        self._new_rows.pop(request.row, None)
        rows, columns, blocks = self._entries
        keep = [i for i, r in enumerate(rows) if r != request.row]
        self._entries = ([rows[i] for i in keep], [columns[i] for i in keep], [blocks[i] for i in keep])
        self.free_rows.append(request.row)
        request.row = None
        request.blocks = []
        request.num_computed = 0
        request.num_cached_blocks, request.last_key = 0, ROOT

    def computed(self, request: Request, n: int) -> None:
        """The step computed n more tokens of request: register the blocks they filled in the prefix cache."""
        request.num_computed += n
        size = self.block_size
        while (request.num_cached_blocks + 1) * size <= request.num_computed:
            index = request.num_cached_blocks
            tokens = request.token_ids[index * size : (index + 1) * size]
            request.last_key = self.blocks.cache_full_block(request.blocks[index], request.last_key, tokens)
            request.num_cached_blocks += 1
