"""ModelRunner: runs the scheduler's steps on a Llama-family model over a paged KV pool.

It owns what lives on the device: the KV pool (which it sizes from the memory the weights and one
largest step leave, initialize()) and its block tables, the rotary tables, the CUDA graphs, and each
table row's last sampled token; and, on the host, each row's request and blocks as the scheduler
handed them (fp8route.engine.scheduler_output: plain data by request id, taken in before each step).
A step is one forward over a flat batch of tokens:

- every piece one token long (a decode step): the batch's CUDA graph, one per batch bucket, with the
  split-KV decode kernel (it rotates and writes the new key itself);
- otherwise: one eager forward over all tokens, its work between attentions replayed from CUDA
  graphs per token-count bucket (fp8route.engine.prefill_graphs), its attention one call per layer
  over every row (fp8route.engine.attention.StepAttention).

Then the sampled rows' logits reach lm_head and the sampler, and the chosen tokens are stored for each
row on the device (the next decode of that row reads its input there, so the host need not have
seen it) and copied back to pinned host memory behind the step. Nothing in a step waits for the GPU.
"""

from __future__ import annotations

import bisect
import functools
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from fp8route.engine.attention import (
    LENGTH_CLASS,
    DecodeAttention,
    FreshChunks,
    StepAttention,
    fresh_attention,
    triton_decode_available,
)
from fp8route.engine.blocks import SCRATCH_BLOCK, blocks_for
from fp8route.engine.config import EngineConfig
from fp8route.engine.decode_graphs import INPUTS, DecodeGraphs, buckets, padded_inputs
from fp8route.engine.flashinfer_attention import FlashInferAttention
from fp8route.engine.kv_pool import KVPool, upload, upload_parts
from fp8route.engine.kv_quant import KVScales
from fp8route.engine.prefill_graphs import MAX_TOKENS, PrefillGraphs, why_not_graphed
from fp8route.engine.request import TokenLogprobs
from fp8route.engine.sampler import Draw, Logprobs, Sampler, token_logprobs
from fp8route.engine.scheduler_output import NewRequest, ScheduledSeq, SchedulerOutput
from fp8route.engine.step_cost import StepCost, copy_gbs, fit
from fp8route.errors import Fp8InputError
from fp8route.kernels.argmax import greedy_tokens
from fp8route.kernels.options import why_not_pdl
from fp8route.kernels.paged_attention import TRITON_IMPORT_ERROR, Sequences
from fp8route.models.llama import LlamaForCausalLM, rope_tables

log = logging.getLogger("fp8route")
_LOGPROB_SLICE = 1024  # prompt positions per lm_head call when scoring a prompt
CPU_KV_TOKENS = 32768  # a CPU pool's size: no device memory to size it from
_GRAPH_RESERVE = 1 << 30  # decode graphs' own memory (logits and activations per bucket), kept free
# Steps timed for the step cost, in a row: with async scheduling a step's host work overlaps the step
# before, and a cost fitted to steps timed one at a time counts it again (and an ITL target's chunks shrink).
STEPS_IN_A_ROW = 4
FRESH_CHUNKS_TIMED = (1, 3)  # how a measured step splits its fresh tokens: one prompt, several


@dataclass
class PromptLogprobs:
    """The prompt log-probabilities a step computes: entries[i] = (request id, position scored)."""

    entries: list[tuple[str, int]]
    ks: list[int]
    tensors: list[torch.Tensor]  # token_logprobs' tensors for the entries


@dataclass
class StepResult:
    """A step read back: the sampled rows' tokens and, for the rows that asked, their log-probabilities
    (by index into the rows); the prompt positions' log-probabilities as (request id, position, values)."""

    tokens: list[int]
    logprobs: dict[int, TokenLogprobs]
    prompt_logprobs: list[tuple[str, int, TokenLogprobs]]


@dataclass
class Forward:
    """A step whose forward is launched and whose tokens are not chosen yet."""

    out: SchedulerOutput
    sampling: list[ScheduledSeq]
    logits: torch.Tensor | None
    greedy: torch.Tensor | None
    prompt: PromptLogprobs | None
    rows: torch.Tensor | None  # the sampled pieces' table rows, on the device
    constrained: list[int]  # the sampled pieces whose output a grammar constrains (indices into sampling)


@dataclass
class InFlight:
    """A launched step: its pieces, those that sample (in the order of the tokens), what it computed
    on the device and (on a GPU) on its way to pinned host memory behind the step."""

    out: SchedulerOutput
    sampling: list[ScheduledSeq]
    tensors: list[torch.Tensor]  # the tokens, then the rows' Logprobs, then the prompt's
    logprobs: Logprobs | None = None
    prompt: PromptLogprobs | None = None
    host: list[torch.Tensor] | None = None
    copied: torch.cuda.Event | None = None

    def __post_init__(self) -> None:
        """The results are taken as they are now: a CUDA graph's next replay overwrites its outputs."""
        if not self.tensors:
            return
        if not self.tensors[0].is_cuda:
            self.host = [t.clone() for t in self.tensors]
            return
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in self.tensors]
        for host, tensor in zip(self.host, self.tensors, strict=True):
            host.copy_(tensor, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def read(self) -> StepResult:
        """The step's results on the host: the one wait for the GPU."""
        if self.host is None:
            return StepResult([], {}, [])
        if self.copied is not None:
            self.copied.synchronize()
        host = self.host
        logprobs: dict[int, TokenLogprobs] = {}
        if self.logprobs is not None:
            values = Logprobs.read(host[1:6], self.logprobs.ks)
            logprobs = dict(zip(self.logprobs.rows, values, strict=True))
        prompt: list[tuple[str, int, TokenLogprobs]] = []
        if self.prompt is not None:
            values = Logprobs.read(host[-5:], self.prompt.ks)
            prompt = [(r, p, v) for (r, p), v in zip(self.prompt.entries, values, strict=True)]
        return StepResult(host[0].tolist(), logprobs, prompt)


class ModelRunner:
    pool: KVPool  # set_pool's: replaced whole when the engine sizes it

    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        *,
        device: torch.device,
        kv_scales: KVScales | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        """A runner for a config the engine resolved, over a scratch pool until initialize() sizes the
        real one; eos_token_ids: what min_tokens holds back besides a request's stop ids."""
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None, "an unresolved config"
        self.config, self.model, self.device, self.dtype = config, model, device, config.torch_dtype
        self.block_size, self.max_rows = config.block_size, config.max_num_seqs
        # lm_head's rows outside the graphs, a mixed step's sampled rows and a prompt's scored positions,
        # padded to these counts (padded_to) on a GPU, where warm_up runs each.
        self.pad_lm_head = device.type == "cuda"
        self.lm_head_rows = sorted({*buckets(self.max_rows), *range(128, _LOGPROB_SLICE + 1, 128)})
        self.max_seq_len, self.max_num_batched_tokens = config.max_model_len, config.max_num_batched_tokens
        self.kv_scales, self.attention = kv_scales, config.attention
        self.use_cuda_graphs = config.use_cuda_graphs and device.type == "cuda"
        # Each decode bucket's graph with and without PDL, the faster kept, where PDL is left open.
        self.measure_pdl = self.use_cuda_graphs and config.pdl is None and why_not_pdl(device) is None
        self.use_prefill_graphs = config.prefill_graphs
        self.use_triton: bool | None = None  # attention kernels: None = Triton on CUDA when it imports
        self.eos_token_ids = tuple(eos_token_ids)
        self.sampler = Sampler(model.cfg.vocab_size, self.max_rows + 1, device)
        # Computed once for every position the cache can hold, then indexed: the same values
        # rope_tables gives for any positions, without per-step host work.
        self.rope_cos, self.rope_sin = rope_tables(model.cfg, torch.arange(self.max_seq_len, device=device))
        self.last_token = torch.zeros(self.max_rows + 1, dtype=torch.int64, device=device)  # per table row
        self.held: dict[int, NewRequest] = {}  # each table row's request, as the scheduler gave it
        self.blocks: dict[int, list[int]] = {}  # each table row's blocks: the host's copy of the pool's tables
        self.prefill_graphs: PrefillGraphs | None = None
        self.step_cost: StepCost | None = None  # measured by initialize() under an ITL target
        # measure_fresh_route's ms: (tokens, chunks) -> (paged, own)
        self.fresh_choice: dict[tuple[int, int], tuple[float, float]] = {}
        self.set_pool(2)
        # The fewest fresh tokens a step sends through their own attention (None: none does): on a CPU
        # any; on a GPU measured by initialize(), the paged kernel until then.
        self.fresh_min_tokens: int | None = 1 if device.type == "cpu" and self._fresh_route_open() else None
        if device.type == "cuda" and not triton_decode_available():
            log.warning(
                "attention runs in torch, not fp8route's Triton kernels (%s): every step gathers "
                "its rows' K/V and reads their lengths back to the host",
                TRITON_IMPORT_ERROR,
            )

    def initialize(self, quiet: bool = False) -> int:
        """Size the pool and capture every graph and compile every kernel variant a step can meet,
        before any request waits for them; the pool's block count."""
        start = time.perf_counter()
        # Measured before the pool takes the memory its copies need.
        read_gbs = copy_gbs(self.device) if self.config.itl_target_ms is not None else None
        graphs = self.prefill_graphs_for(1)
        if graphs is not None:  # before the pool is sized, which then counts their memory as taken
            graphs.capture_all()
        self.set_pool(self.config.num_kv_blocks or self.fit_blocks())
        if graphs is not None and self.triton and not self.config.deterministic:
            # The whole-step graphs hold the pool's addresses, so they are captured after it, into the
            # pieces' memory pool (the same activations, which the pool's sizing counted as taken).
            graphs.attach(self.pool, self.max_rows, self.rope_cos.dtype)
            graphs.capture_all()
        if self.device.type == "cuda" and self._fresh_route_open():  # before warm_up, which then warms it
            self.fresh_min_tokens = self.measure_fresh_route()
        if self.use_cuda_graphs:
            self.capture_decode_graphs(self.max_rows)
            self.warm_up()
            torch.cuda.synchronize(self.device)
        self.step_cost = self.measure_step_cost(read_gbs) if read_gbs is not None else None
        if not quiet:
            pool = self.pool
            eager = self.why_prefill_eager() if self.use_cuda_graphs and graphs is None else None
            print(
                f"fp8route: KV cache {pool.capacity_tokens} tokens ({pool.num_blocks - 1} blocks of "
                f"{pool.block_size}, {pool.nbytes / 2**30:.2f} GiB {str(pool.dtype).removeprefix('torch.')}) on "
                f"{pool.device}; context {self.max_seq_len} tokens"
                + (f"; graphs captured in {time.perf_counter() - start:.1f} s" if self.use_cuda_graphs else "")
                + (f"; {self.graphs.pdl_note()}" if self.graphs is not None and self.graphs.pdl_choices else "")
                + (f"; mixed steps run eagerly: {eager}" if eager else "")
                + f"; {self.fresh_route_note()}"
                + (f"; {torch.get_num_threads()} CPU threads" if self.device.type == "cpu" else "")
                + (f"; a step takes {self.step_cost}" if self.step_cost is not None else ""),
                file=sys.stderr,
            )
        return self.pool.num_blocks

    def measure_step_cost(self, read_gbs: float) -> StepCost:
        """A StepCost fitted to mixed steps timed here (_time's, run in a row as serving runs them): one
        short and one full chunk, alone and beside a quarter of the budget in decodes; a cached position
        priced at its K/V bytes read at read_gbs."""
        tokens = min(self.max_num_batched_tokens, self.max_seq_len)
        decodes = max(1, min(self.max_rows - 1, tokens // 4))
        points = {(0, min(16, tokens)), (0, tokens), (decodes, min(decodes + 16, tokens)), (decodes, tokens)}
        samples = []
        for singles, total in sorted(points):
            if total - singles < 1:
                continue
            step = functools.partial(self.dummy_forward, total, singles, fresh_from=self.fresh_min_tokens)
            ms = self._time(step, in_a_row=STEPS_IN_A_ROW if self.config.async_scheduling else 1)
            samples.append((singles + 1, total, ms))
        return replace(fit(samples), per_position_ms=self.pool.bytes_per_token / (read_gbs * 1e6))

    def _fresh_route_open(self) -> bool:
        """Whether fresh chunks may attend over their own K/V: not with FlashInfer's prefill, or in the
        deterministic mode (a prompt's arithmetic must not depend on how it was chunked)."""
        return self.flashinfer is None and not self.config.deterministic

    def measure_fresh_route(self) -> int | None:
        """The fewest fresh tokens from which a step of fresh chunks runs faster with them over their own
        K/V (SDPA, the step's attention outside the graphs) than through the paged kernel (the whole step
        in a graph), both in one chunk and split in three (a call per chunk): steps timed here (median of
        three); None where the paged kernel is never slower."""
        most = min(self.max_num_batched_tokens, self.max_seq_len)
        sizes = [n for n in (256, 512, 1024, 2048, 4096, 8192) if n <= most]
        faster = []
        for tokens in sizes:
            wins = True
            for chunks in FRESH_CHUNKS_TIMED:
                paged, own = (
                    self._time(functools.partial(self.dummy_forward, tokens, 0, chunks, fresh_from=route))
                    for route in (None, 1)
                )
                self.fresh_choice[tokens, chunks] = (paged, own)
                wins = wins and own < paged
            faster.append(wins)
        # The smallest size from which it wins at every larger one too.
        wins_from = [n for i, n in enumerate(sizes) if all(faster[i:])]
        return wins_from[0] if wins_from else None

    def warm_fresh_route(self) -> None:
        """cuDNN's plan for each length fresh chunks are read as (multiples of LENGTH_CLASS), made now in
        the calling thread (torch keeps them per thread; each first costs tens of ms), so that no step
        waits for one."""
        if self.fresh_min_tokens is None or self.device.type != "cuda":
            return
        cfg = self.model.cfg
        most = -(-min(self.max_num_batched_tokens, self.max_seq_len) // LENGTH_CLASS) * LENGTH_CLASS
        q, out = torch.zeros(2, most, cfg.num_attention_heads, cfg.head_size, dtype=self.dtype, device=self.device)
        kv = torch.zeros(2, most, cfg.num_key_value_heads, cfg.head_size, dtype=self.dtype, device=self.device)
        for n in range(LENGTH_CLASS, most + 1, LENGTH_CLASS):
            fresh_attention(q, kv[0], kv[1], [0, n], out, LENGTH_CLASS)

    def fresh_route_note(self) -> str:
        """One line on how fresh chunks attend, for the start-up summary, with what chose it."""
        timed = "; ".join(f"{n} in {c}: {a:.2f} / {b:.2f} ms" for (n, c), (a, b) in self.fresh_choice.items())
        measured = f" (steps of fresh tokens in chunks, paged / SDPA: {timed})" if timed else ""
        if self.fresh_min_tokens is None:
            return "fresh chunks through the paged kernel" + measured
        return f"fresh chunks of >= {self.fresh_min_tokens} tokens a step through SDPA" + measured

    def _time(self, run: Callable[[], object], in_a_row: int = 1) -> float:
        """run's median wall time over three timings after an untimed call (a first call may compile), in
        ms; each timing runs it in_a_row times between syncs, so that the host's work for a call
        overlaps the device's for the one before, as it does for steps in serving."""
        run()
        times = []
        for _ in range(3):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            for _ in range(in_a_row):
                run()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append((time.perf_counter() - start) / in_a_row)
        return 1e3 * sorted(times)[1]

    def fit_blocks(self) -> int:
        """Blocks that fit what is left of gpu_memory_utilization x the GPU's memory after the weights
        and one largest step's activations, through the paged kernel and with a fresh chunk on its own
        route (CPU_KV_TOKENS on a CPU); every rank of a tensor-parallel group takes the smallest count,
        so that all schedule alike."""
        config = self.config
        if self.device.type != "cuda":
            tokens = min(CPU_KV_TOKENS, self.max_rows * self.max_seq_len)
            return 1 + blocks_for(tokens, self.block_size)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        tokens = min(self.max_num_batched_tokens, self.max_seq_len)
        self.dummy_forward(tokens, min(self.max_rows, tokens - 1), fresh_from=self.fresh_min_tokens)
        if self._fresh_route_open():  # its buffers, whichever route the measurement picks later
            self.dummy_forward(tokens, 0, fresh_from=1)
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - before
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * config.gpu_memory_utilization) - (total - free) - activations - _GRAPH_RESERVE
        blocks = torch.tensor(budget // (self.pool.bytes_per_token * self.block_size), device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(blocks, op=dist.ReduceOp.MIN)
        if int(blocks) < 2:
            raise Fp8InputError(
                f"no GPU memory left for the KV cache: {budget / 2**30:.2f} GiB after the weights and a "
                f"{tokens}-token step at gpu_memory_utilization={config.gpu_memory_utilization}; raise it, or "
                "lower max_num_batched_tokens"
            )
        return int(blocks) + 1

    # -- the pool and what was captured over it -------------------------------------------------

    def set_pool(self, num_blocks: int) -> None:
        """A pool of num_blocks (the engine sizes the real one after a profile run). The decode graphs
        captured the old pool's addresses, so they go; the old pool's memory goes before the new one."""
        self.graphs: DecodeGraphs | None = None
        self.flashinfer: FlashInferAttention | None = None
        if self.prefill_graphs is not None:
            self.prefill_graphs.detach()
        if hasattr(self, "pool"):
            del self.pool
        cfg = self.model.cfg
        self.pool = KVPool(
            cfg.num_hidden_layers, num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_size,
            self.max_rows, self.max_seq_len, self.dtype, self.device, self.kv_scales,
        )  # fmt: skip
        self.blocks = {self.pool.pad_row: [SCRATCH_BLOCK] * self.pool.max_blocks_per_seq}
        if self.attention == "flashinfer":
            self.flashinfer = FlashInferAttention(self.pool, cfg.num_attention_heads, self.dtype, self.device)

    def drop_graphs(self) -> None:
        """Forget every captured graph (the model's tensors moved)."""
        self.graphs = None
        self.prefill_graphs = None

    @property
    def plans_on_host(self) -> bool:
        """Whether a step needs each row's host lengths and blocks (FlashInfer plans from them)."""
        return self.flashinfer is not None

    @property
    def triton(self) -> bool:
        """Whether attention runs fp8route's Triton kernels: use_triton when set (True on a CPU needs
        Triton's interpreter, TRITON_INTERPRET=1), else on CUDA when Triton imports."""
        if self.use_triton is not None:
            return self.use_triton
        return self.device.type == "cuda" and triton_decode_available()

    # -- a step ------------------------------------------------------------------------------------

    def forward(self, out: SchedulerOutput) -> Forward:
        """Take in out's rows and blocks and launch its forward: the logits of the pieces that sample."""
        self._take_in(out)
        seqs = out.seqs
        sampling = [s for s in seqs if s.samples]
        prompt = None
        if out.singles == len(seqs) and not any(self._scores_prompt(s) for s in seqs):
            logits, greedy = self._decode(seqs)
            if len(sampling) < len(seqs):
                picked = upload(torch.tensor([i for i, s in enumerate(seqs) if s.samples]), self.device)
                logits, greedy = logits[picked], greedy[picked]
        else:
            (logits, prompt), greedy = self._forward(out, self.fresh_min_tokens), None
        # The rows are taken now: a request that the step before ends (read back while the masks are
        # made) gives its row up before this step samples.
        rows = upload(torch.tensor([s.row for s in sampling]), self.device) if sampling else None
        constrained = [i for i, s in enumerate(sampling) if self.held[s.row].constrained]
        return Forward(out, sampling, logits if sampling else None, greedy, prompt, rows, constrained)

    def sample(self, step: Forward, masks: torch.Tensor | None = None) -> InFlight:
        """Choose the step's tokens (masks: the constrained rows' bitmasks, on the host) and start
        their copy back; each row's token is kept on the device for its next decode."""
        prompt_tensors = step.prompt.tensors if step.prompt is not None else []
        if step.logits is None:
            if not prompt_tensors:
                return InFlight(step.out, [], [])
            none = torch.empty(0, dtype=torch.int64, device=self.device)
            return InFlight(step.out, [], [none, *prompt_tensors], None, step.prompt)
        draws = [Draw(self.held[s.row].params, self.held[s.row].seed, s.output_index) for s in step.sampling]
        rows = step.rows
        assert rows is not None
        where = None if masks is None else (step.constrained, upload(masks, self.device))
        tokens, logprobs = self.sampler(step.logits, step.greedy, draws, rows, self.eos_token_ids, where)
        self.last_token.index_copy_(0, rows, tokens)
        tensors = [tokens, *(logprobs.tensors() if logprobs is not None else []), *prompt_tensors]
        return InFlight(step.out, step.sampling, tensors, logprobs, step.prompt)

    def _take_in(self, out: SchedulerOutput) -> None:
        """The rows given this step and the blocks added to running ones, into the host's tables and the
        pool's; a penalized request given a row starts the row's counts over from what it has seen."""
        for new in out.new_requests:
            self.held[new.row] = new
            self.blocks[new.row] = list(new.block_ids)
            if new.params.penalized:
                self.sampler.admit(new.row, new.prompt_token_ids, new.output_token_ids)
        if out.new_requests:
            self.pool.set_rows([n.row for n in out.new_requests], [n.block_ids for n in out.new_requests])
        for row, column, block in out.new_blocks:
            assert column == len(self.blocks[row]), "blocks are appended in order"
            self.blocks[row].append(block)
        if out.new_blocks:
            rows, columns, blocks = zip(*out.new_blocks)
            self.pool.set_entries(rows, columns, blocks)

    def _decode(self, seqs: Sequence[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every piece one token: (logits, argmax) of each row."""
        host = decode_inputs(seqs)
        lengths = [s.start + 1 for s in seqs] if self.plans_on_host else None
        return self.decode(
            host, limit=int(host[2].max()) + 1, host_lengths=lengths,
            host_blocks=[self.blocks[s.row] for s in seqs] if lengths else None,
        )  # fmt: skip

    def decode(
        self,
        host: np.ndarray,
        *,
        limit: int | None = None,
        host_lengths: Sequence[int] | None = None,
        host_blocks: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """decode_step over the inputs on the host ([4, B], decode_inputs' layout), replayed from the
        batch bucket's CUDA graph on a GPU with use_cuda_graphs. host_lengths (positions + 1) and
        host_blocks (each row's blocks) are what FlashInfer plans from."""
        graphs = None
        if self.use_cuda_graphs:
            if self.graphs is None:
                self.graphs = DecodeGraphs(
                    self.decode_step, self.max_rows, self.pool.pad_row, self.device, self.measure_pdl
                )
            graphs = self.graphs
        if self.flashinfer is not None:
            assert host_lengths is not None and host_blocks is not None
            size = graphs.bucket(host.shape[1]) if graphs is not None else host.shape[1]
            self.flashinfer.plan_decode(size, host_lengths, host_blocks)
        if graphs is not None:
            return graphs.run(host)
        ids, pending, positions, rows = upload(torch.from_numpy(host), self.device)
        return self.decode_step(ids, pending, positions, rows, limit)

    def decode_step(
        self,
        ids: torch.Tensor,
        pending: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        limit: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row: row b computes position positions[b] of table row rows[b], its input
        ids[b], or the row's last sampled token where pending[b] -> (logits [B, vocab], argmax [B]).
        Reads only device tensors and never syncs the host, so a CUDA graph can capture it. limit (a
        host bound on positions + 1) narrows the eager torch attention's read; a captured step passes None."""
        tokens = torch.where(pending.bool(), self.last_token[rows], ids)
        h = self.model.model.embed_tokens(tokens)[:, None].to(self.dtype)
        cos = self.rope_cos[positions][:, None]  # [B, 1, D]: each row at its own position
        sin = self.rope_sin[positions][:, None]
        context = DecodeAttention(
            self.pool, positions, rows, limit, self.use_triton, self.flashinfer, alone=self.config.deterministic
        )
        logits = self.model.lm_head(self.model.model.run_layers(h, cos, sin, context)[:, 0])
        return logits, greedy_tokens(logits)

    def _forward(self, out: SchedulerOutput, fresh_from: int | None) -> tuple[torch.Tensor, PromptLogprobs | None]:
        """One forward over every piece's tokens: the logits of the pieces that sample, and the
        log-probabilities of the prompt positions asked for. fresh_from: the fewest fresh tokens sent
        over their own K/V (_fresh)."""
        seqs = out.seqs
        starts, counts, offsets, positions, ids, pending, token_rows, slots, sample_at = step_inputs(
            seqs, self.blocks, self.block_size
        )
        total = int(offsets[-1])
        sampled = len(sample_at)
        parts = upload_parts(
            [ids, pending, positions, slots, token_rows, offsets, starts + counts, token_rows[offsets[:-1]],
             padded_to(sample_at, self.lm_head_rows) if self.pad_lm_head else sample_at,
             np.array([out.singles, len(seqs)])],
            self.device,
        )  # fmt: skip
        ids_d, pending_d, pos_d, slots_d, token_rows_d, cu_q, lengths, rows, sample_d, seq_counts = parts
        if pending.any():
            ids_d = torch.where(pending_d.bool(), self.last_token[token_rows_d], ids_d)
        if self.flashinfer is not None:
            blocks = [self.blocks[s.row] for s in seqs]
            self.flashinfer.plan_prefill(counts.tolist(), (starts + counts).tolist(), blocks)
        layout = Sequences(cu_q, lengths, rows, out.singles)
        fresh = self._fresh(seqs, out.singles, offsets, fresh_from)
        context = StepAttention(
            self.pool, slots_d, layout, self.triton, self.flashinfer, fresh, self.config.deterministic, seq_counts
        )
        h = self.model.model.embed_tokens(ids_d).to(self.dtype)
        cos, sin = self.rope_cos[pos_d][None], self.rope_sin[pos_d][None]
        graphs = self.prefill_graphs_for(total)
        if graphs is not None:
            normed = graphs.run(h, cos, sin, context)
        else:
            normed = self.model.model.run_layers(h[None], cos, sin, context)[0]
        logits = self.model.lm_head(normed[sample_d])[:sampled]
        return logits, self._prompt_logprobs(seqs, offsets[:-1].tolist(), normed)

    def _fresh(
        self, seqs: Sequence[ScheduledSeq], singles: int, offsets: np.ndarray, fresh_from: int | None
    ) -> FreshChunks | None:
        """The step's trailing fresh chunks (the scheduler puts them last), when they hold at least
        fresh_from tokens; None: every sequence through the paged kernel."""
        if fresh_from is None:
            return None
        first = len(seqs)
        while first > singles and seqs[first - 1].start == 0 and seqs[first - 1].num_tokens > 1:
            first -= 1
        if first == len(seqs) or int(offsets[-1] - offsets[first]) < fresh_from:
            return None
        return FreshChunks(first, tuple(offsets[first:].tolist()))

    def _prompt_logprobs(
        self, seqs: Sequence[ScheduledSeq], firsts: list[int], normed: torch.Tensor
    ) -> PromptLogprobs | None:
        """Each asked-for prompt position's log-probability (a position's logits score the token after
        it), through lm_head a slice of positions at a time: a long chunk's logits need not fit at once."""
        entries: list[tuple[str, int]] = []
        flat: list[int] = []
        targets: list[int] = []
        ks: list[int] = []
        for s, first in zip(seqs, firsts, strict=True):
            if not self._scores_prompt(s):
                continue
            request = self.held[s.row]
            last = min(s.start + s.num_tokens, len(request.prompt_token_ids) - 1)  # positions start .. last - 1
            entries += [(s.request_id, position) for position in range(s.start + 1, last + 1)]
            flat += range(first, first + last - s.start)
            targets += request.prompt_token_ids[s.start + 1 : last + 1]
            ks += [request.params.prompt_logprobs or 0] * (last - s.start)
        if not entries:
            return None
        count = len(flat)
        if self.pad_lm_head:  # the last slice's rows padded as a mixed step's sampled rows are
            tail = (count - 1) // _LOGPROB_SLICE * _LOGPROB_SLICE
            flat = flat[:tail] + padded_to(np.array(flat[tail:]), self.lm_head_rows).tolist()
        where, tokens = upload(torch.tensor([flat, targets + [0] * (len(flat) - count)]), self.device)
        parts = []
        for i in range(0, count, _LOGPROB_SLICE):
            real = min(_LOGPROB_SLICE, count - i)
            logits = self.model.lm_head(normed[where[i : i + _LOGPROB_SLICE]])[:real]
            parts.append(token_logprobs(logits, tokens[i : i + real], max(ks)))
        return PromptLogprobs(entries, ks, [torch.cat(column) for column in zip(*parts, strict=True)])

    def _scores_prompt(self, piece: ScheduledSeq) -> bool:
        """Whether the piece computes positions whose logits score a prompt token its request asked for."""
        request = self.held.get(piece.row)
        return (
            request is not None
            and request.params.prompt_logprobs is not None
            and piece.start < len(request.prompt_token_ids) - 1
        )

    # -- graphs and warm-up --------------------------------------------------------------------------

    def prefill_graphs_for(self, tokens: int) -> PrefillGraphs | None:
        """The graphs for a forward of this many tokens (None: eager). Made on first use on CUDA with
        use_cuda_graphs and use_prefill_graphs, builtin attention and no tensor parallelism."""
        if not self.use_prefill_graphs:
            return None
        graphs = self.prefill_graphs
        if graphs is None and self.use_cuda_graphs and self.why_prefill_eager() is None:
            most = min(MAX_TOKENS, self.max_num_batched_tokens)
            graphs = self.prefill_graphs = PrefillGraphs(self.model.model, most, self.device, self.dtype)
        return graphs if graphs is not None and tokens <= graphs.max_tokens else None

    def why_prefill_eager(self) -> str | None:
        """Why this model's mixed steps cannot run from the prefill graphs (None: they can)."""
        if self.flashinfer is not None:
            return "FlashInfer's prefill plans its own call per forward"
        return why_not_graphed(self.model.model)

    def capture_decode_graphs(self, max_num_seqs: int) -> int:
        """Every decode bucket's graph now, so that no request waits for a capture; how many."""
        sizes = buckets(max_num_seqs)
        for size in sizes:
            padding = padded_inputs(np.zeros((INPUTS, 0), dtype=np.int64), size, self.pool.pad_row)[:, :size]
            self.decode(padding, host_lengths=[1] * size, host_blocks=[[0]] * size)
        return len(sizes)

    def dummy_forward(
        self, tokens: int, singles: int, chunks: int = 1, continuing: int = 0, *, fresh_from: int | None
    ) -> None:
        """A mixed step of `singles` one-token rows and `chunks` chunks sharing the other tokens (the
        first `continuing` of them after one cached position, the rest fresh), every row on the padding
        row (its K/V into the scratch block), fresh chunks of fresh_from tokens or more on their own
        route: to measure activations and routes, and to compile what a step of these counts compiles
        before any request waits for it."""
        pad = self.pool.pad_row
        rest = tokens - singles
        sizes = [rest // chunks + (i < rest % chunks) for i in range(chunks)]
        seqs = [ScheduledSeq("dummy", pad, 0, 1, [0], False, 0) for _ in range(singles)]
        seqs += [ScheduledSeq("dummy", pad, int(i < continuing), n, [0] * n, True, 0) for i, n in enumerate(sizes)]
        self._forward(SchedulerOutput(seqs), fresh_from)

    def warm_up(self) -> None:
        """Compile the kernel variants a mixed step can take (Triton tells apart a count of 1, one
        divisible by 16, and any other), and the sampler's, before a request waits for one."""
        for singles in (0, 1, 3, 16):
            for chunks in (1, 3, 16):
                for extra in (0, 1):
                    self.dummy_forward(singles + 2 * chunks + extra, singles, chunks, fresh_from=self.fresh_min_tokens)
        if self.fresh_min_tokens is not None:
            # A step with fresh chunks on their own runs the paged kernel eagerly over its other
            # sequences: the variants of those counts, each step's fresh chunks sent so.
            for singles in (0, 1, 3, 16):
                for continuing in (0, 1, 3, 16):
                    for extra in (0, 1):
                        tokens = singles + 2 * continuing + 2 + extra
                        self.dummy_forward(tokens, singles, continuing + 1, continuing, fresh_from=1)
            self.warm_fresh_route()
        if self.pad_lm_head:
            hidden = self.model.model.norm.weight.shape[0]
            for size in self.lm_head_rows:
                self.model.lm_head(torch.zeros(size, hidden, dtype=self.dtype, device=self.device))
        self.sampler.warm_up(self.dtype, self.eos_token_ids)


class StepInputs(NamedTuple):
    """A mixed step's inputs on the host, as int64 arrays. Per piece: where it starts in its sequence
    (starts), how many tokens it brings (counts) and where they start in the flat batch (offsets, with
    the total last). Per token of the batch: its position, its id (0 where pending), whether it is
    pending (the row's last sampled token, which the device reads), its table row and its KV slot
    (block * block_size + offset). sample_at: the batch index of each sampling piece's last token."""

    starts: np.ndarray
    counts: np.ndarray
    offsets: np.ndarray
    positions: np.ndarray
    ids: np.ndarray
    pending: np.ndarray
    token_rows: np.ndarray
    slots: np.ndarray
    sample_at: np.ndarray


def step_inputs(seqs: Sequence[ScheduledSeq], blocks: Mapping[int, Sequence[int]], page: int) -> StepInputs:
    """The flat batch of these pieces over each table row's blocks (page: the block size): host work
    only, no device or model."""
    starts = np.array([s.start for s in seqs], dtype=np.int64)
    counts = np.array([s.num_tokens for s in seqs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    total = int(offsets[-1])
    positions = np.arange(total, dtype=np.int64) - np.repeat(offsets[:-1] - starts, counts)
    ids = np.zeros(total, dtype=np.int64)
    pending = np.zeros(total, dtype=np.int64)
    token_rows = np.repeat(np.array([s.row for s in seqs], dtype=np.int64), counts)
    slots = np.empty(total, dtype=np.int64)
    # One-token pieces (a mixed step's decodes, up to max_num_seqs of them) in one pass over plain lists:
    # a numpy call or two per piece cost the host about 6 us each.
    one = [s for s in seqs if s.num_tokens == 1]
    if one:
        at = offsets[:-1][counts == 1]
        ids[at] = [s.token_ids[0] if s.token_ids else 0 for s in one]
        pending[at] = [not s.token_ids for s in one]
        slots[at] = (
            np.array([blocks[s.row][s.start // page] for s in one], dtype=np.int64) * page + positions[at] % page
        )
    for s, first in zip(seqs, offsets[:-1].tolist(), strict=True):
        if s.num_tokens == 1:
            continue
        known = s.token_ids
        ids[first : first + len(known)] = known
        pending[first + len(known) : first + s.num_tokens] = 1
        table = np.asarray(blocks[s.row], dtype=np.int64)
        where = positions[first : first + s.num_tokens]
        slots[first : first + s.num_tokens] = table[where // page] * page + where % page
    sample_at = (offsets[1:] - 1)[[i for i, s in enumerate(seqs) if s.samples]]
    return StepInputs(starts, counts, offsets, positions, ids, pending, token_rows, slots, sample_at)


def padded_to(rows: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
    """Positions whose logits lm_head computes, padded (repeating the last) to the smallest of sizes
    that holds them, so that lm_head meets only the row counts warm_up ran: on the H100 lm_head's eager
    cuBLAS GEMM at row counts it had not met held the host about as long as a mixed step's GPU work
    (issue 47)."""
    if not len(rows):
        return rows
    size = sizes[bisect.bisect_left(sizes, len(rows))]
    return np.pad(rows, (0, size - len(rows)), mode="edge")


def decode_inputs(seqs: Sequence[ScheduledSeq]) -> np.ndarray:
    """A decode step's inputs on the host, [4, B] int64: each row's token (0 where pending), whether it
    is pending (the row's last sampled token, which the device reads), its position and its table row."""
    return np.array(
        [
            [s.token_ids[0] if s.token_ids else 0 for s in seqs],
            [not s.token_ids for s in seqs],
            [s.start for s in seqs],
            [s.row for s in seqs],
        ],
        dtype=np.int64,
    )
