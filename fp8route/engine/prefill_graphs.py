"""A packed prefill forward replayed from CUDA graphs: the whole step, or everything but the attention.

An eager prefill issues some 15 kernels a layer through Python: host time that does not shrink
with the token count and, for a mixed step of moderate size, is longer than the GPU's own (the
runs that show it: docs/results.md). Everything in a layer but the attention (o_proj, the residual
adds and norms, the MLP, the next layer's q/k/v projections) depends only on the token count; the
attention depends on how the tokens split into sequences and where each sits in the cache.

So each token-count bucket gets, once the engine's KV pool exists (attach), one graph of the whole
step: the attention's inputs (every token's slot and rotary cos/sin, the sequences' offsets, lengths,
table rows and counts) are static buffers copied in before a replay, and the paged attention kernel
reads the step's counts on the device, its grids sized from bounds (Sequences.counts). Steps whose
attention cannot run so (fresh chunks over their own K/V through SDPA, the deterministic mode's host
split, more sequences than the bound) run the pieces: one graph per gap between attentions, the first
taking the embeddings to layer 0's q/k/v, each next one an attention's output to the next layer's
q/k/v, the last ending at the final norm, the attention eager between them.

Graphs talk through static buffers sized for the largest bucket. T tokens run in the smallest
bucket >= T; the rows past T are zero before every forward, and every linear's input stays zero
there (a zero row normalizes to zero, the attention writes only real rows; their K/V go to the
scratch block), so a dynamic per-tensor input scale sees the same amax as the eager forward. A
replanned Fp8Linear drops the graphs, as it drops the decode graphs.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from fp8route.device import capture_graph
from fp8route.engine.attention import StepAttention
from fp8route.engine.blocks import SCRATCH_BLOCK
from fp8route.engine.kv_pool import KVPool
from fp8route.kernels.paged_attention import Sequences
from fp8route.linear.layer import plans_epoch

if TYPE_CHECKING:
    from fp8route.models.llama import DecoderLayer, LlamaModel, RMSNorm

# Graphs up to the default step budget, so that every step the scheduler makes skips the eager
# forward's host time.
MAX_TOKENS = 8192
STEP = 128  # bucket spacing up to WIDE, then twice that
WIDE = 2048


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, then every STEP tokens up to WIDE and every 2 * STEP above, up to max_tokens (a
    forward pads by at most 2x below STEP tokens, where it costs about a weight read whatever its
    size, by < STEP up to WIDE and < 2 * STEP, 12% at most, above)."""
    sizes = [s for s in (16, 32, 64) if s < max_tokens]
    sizes += list(range(STEP, min(max_tokens, WIDE + 1), STEP))
    sizes += list(range(WIDE + 2 * STEP, max_tokens, 2 * STEP))
    return sorted({*sizes, max_tokens})


def why_not_graphed(model: LlamaModel) -> str | None:
    """Why a model's prefill cannot run from these graphs (None: it can): not under tensor
    parallelism, whose row-parallel projections sum over the ranks inside the step; not with a bias
    on o_proj or the MLP, which would make padded rows nonzero where a dynamic input scale takes its amax."""
    for layer in cast("list[DecoderLayer]", list(model.layers)):
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn.o_proj, "add_rms_norm") or hasattr(mlp.down_proj, "add_rms_norm"):
            return "tensor parallel projections sum over the ranks inside the step"
        names = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")
        linears = [attn.o_proj, *(getattr(mlp, n) for n in names if hasattr(mlp, n))]
        if any(getattr(linear, "bias", None) is not None for linear in linears):
            return "a bias on o_proj or the MLP would make padded rows nonzero"
    return None


class StepBuffers:
    """What the attention of a whole-step graph reads, copied in before each replay: every token's cache
    slot and rotary cos/sin (rows past the step's tokens: the scratch block's first slot), the
    sequences' query offsets, lengths and table rows (entries past the step's never read) and their
    counts. Bound to one pool, whose addresses the graphs hold; max_seqs: the most sequences a step
    may bring."""

    def __init__(self, pool: KVPool, top: int, max_seqs: int, head_size: int, rope_dtype: torch.dtype) -> None:
        self.pool, self.max_seqs = pool, max_seqs
        self.scratch = SCRATCH_BLOCK * pool.block_size
        device, index = pool.device, torch.int64  # the runner's uploads: the kernels compiled for them

        def zeros(*shape: int, dtype: torch.dtype = index) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        with torch.inference_mode(False):
            self.slots = torch.full((top,), self.scratch, dtype=index, device=device)
            self.cos, self.sin = zeros(top, head_size, dtype=rope_dtype), zeros(top, head_size, dtype=rope_dtype)
            self.cu_q, self.lengths, self.rows = zeros(max_seqs + 1), zeros(max_seqs), zeros(max_seqs)
            self.counts = zeros(2, dtype=torch.int32)  # what the kernel's loop bounds compile for

    def clear(self) -> None:
        """No sequences and every slot scratch: what a capture's first, eager run may write through."""
        self.slots.fill_(self.scratch)
        self.counts.zero_()

    def holds(self, context: StepAttention) -> bool:
        """Whether this step's attention can run from these buffers."""
        return context.graphable and context.pool is self.pool and context.seqs.count <= self.max_seqs

    def load(self, context: StepAttention, cos: torch.Tensor, sin: torch.Tensor, size: int) -> None:
        """The step's inputs in (cos/sin [1, T, D]), its padded rows' slots back to scratch."""
        seqs, t, n = context.seqs, context.slots.shape[0], context.seqs.count
        self.slots[:t].copy_(context.slots)
        if size > t:  # a larger step's slots there are real ones: its padded rows must not write them
            self.slots[t:size].fill_(self.scratch)
        self.cos[:t].copy_(cos[0])
        self.sin[:t].copy_(sin[0])
        self.cu_q[: n + 1].copy_(seqs.cu_q)
        self.lengths[:n].copy_(seqs.lengths)
        self.rows[:n].copy_(seqs.rows)
        assert context.counts is not None  # holds() checked it
        self.counts.copy_(context.counts)

    def attention(self, size: int) -> tuple[StepAttention, torch.Tensor, torch.Tensor]:
        """A bucket's attention over these buffers, and its cos and sin: the step's counts read on the
        device, the sequence counts bounds."""
        seqs = Sequences(self.cu_q, self.lengths, self.rows, min(self.max_seqs, size), self.counts)
        context = StepAttention(self.pool, self.slots[:size], seqs, triton=True, counts=self.counts)
        return context, self.cos[:size][None], self.sin[:size][None]


class PrefillGraphs:
    """Runs LlamaModel.run_layers over a packed prefill from captured graphs: a whole step once attached
    to the engine's pool, else pieces. capture=False runs the same calls eagerly over the same padded
    buffers (what a CPU can test)."""

    def __init__(
        self, model: LlamaModel, max_tokens: int, device: torch.device, dtype: torch.dtype, capture: bool = True
    ) -> None:
        """dtype: the forward's activations (the runner's dtype)."""
        self.model, self.device, self.capture = model, device, capture
        self.layers = cast("list[DecoderLayer]", list(model.layers))
        attn = self.layers[0].self_attn
        self.widths, self.head_size = list(attn.widths), attn.cfg.head_size
        self.sizes = token_buckets(max_tokens)
        hidden = model.norm.weight.shape[0]
        top = self.sizes[-1]

        def buffer(width: int) -> torch.Tensor:
            return torch.zeros(top, width, dtype=dtype, device=device)

        # Ordinary tensors even when made under inference_mode: a later forward outside it writes them.
        with torch.inference_mode(False):
            self.residual, self.normed = buffer(hidden), buffer(hidden)
            self.qkv, self.attn = buffer(sum(self.widths)), buffer(self.widths[0])
        self.used = top  # rows the last forward wrote: those past the next one's tokens are zeroed
        self.pieces: dict[int, list[Callable[[], None]]] = {}
        self.steps: dict[int, Callable[[], None]] = {}  # whole-step graphs, per bucket
        self.inputs: StepBuffers | None = None  # their attention's inputs, once attached to a pool
        self.pool: Any = None  # the memory pool every graph shares
        self.epoch = plans_epoch()

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def bucket(self, tokens: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, tokens)]

    def attach(self, pool: KVPool, max_seqs: int, rope_dtype: torch.dtype) -> None:
        """Whole-step graphs over this pool from now on, for steps of up to max_seqs sequences; a new
        pool must attach again (detach drops the graphs holding the old one's addresses)."""
        self.detach()
        top = self.sizes[-1]
        self.inputs = StepBuffers(pool, top, max_seqs, self.head_size, rope_dtype)

    def detach(self) -> None:
        self.steps.clear()
        self.inputs = None

    def capture_all(self) -> None:
        """Every bucket's pieces now, and its whole step once attached, so that no request waits for a capture."""
        self._check_epoch()
        if self.inputs is not None:
            self.inputs.clear()
        for size in self.sizes:
            if size not in self.pieces:
                self.pieces[size] = self._make(size)
            if self.inputs is not None and size not in self.steps:
                self.steps[size] = self._make_step(size)

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: StepAttention) -> torch.Tensor:
        """h [T, hidden] (embeddings; T <= max_tokens) -> the final norm's output [T, hidden]: the whole
        step from its graph where its attention allows (StepBuffers.holds), else the pieces with the
        attention of each layer eagerly through context, as in run_layers."""
        self._check_epoch()
        t = h.shape[0]
        size = self.bucket(t)
        inputs = self.inputs if self.inputs is not None and self.inputs.holds(context) else None
        # A graph made now runs once first (_captured), before this step's rows are in: over rows it keeps
        # zero where they were, and, for a whole step, over cleared inputs (K/V to the scratch block).
        if inputs is not None and size not in self.steps:
            inputs.clear()
            self.steps[size] = self._make_step(size)
        if inputs is None and size not in self.pieces:
            self.pieces[size] = self._make(size)
        if self.used > t:
            self.residual[t : self.used].zero_()
            self.attn[t : self.used].zero_()
        self.used = size
        self.residual[:t].copy_(h)
        if inputs is not None:
            inputs.load(context, cos, sin, size)
            self.steps[size]()
            return self.normed[:t]
        pieces = self.pieces[size]
        pieces[0]()
        heads = self.attn[:t].view(t, -1, self.head_size)  # [T, H, D]
        for i in range(len(self.layers)):
            q, k, v = (x.view(1, t, -1, self.head_size) for x in self.qkv[:t].split(self.widths, dim=-1))
            context.attend(i, q, k, v, cos, sin, out=heads)
            pieces[i + 1]()
        return self.normed[:t]

    def _check_epoch(self) -> None:
        """Drop every piece when an Fp8Linear was replanned since they were captured."""
        if self.epoch != plans_epoch():
            self.pieces.clear()
            self.steps.clear()
            self.pool = None
            self.epoch = plans_epoch()

    def _piece(self, i: int, size: int) -> None:
        """The work after layer i - 1's attention and up to layer i's (i = 0: from the embeddings;
        i = len(layers): to the final norm), over the first `size` rows of the buffers."""
        residual = self.residual[:size][None]
        if i == 0:
            normed = self.layers[0].input_layernorm(residual)
        else:
            heads = self.attn[:size].view(1, size, -1, self.head_size).transpose(1, 2)
            normed, h = self.layers[i - 1].after_attention(heads, residual, self._norm_before(i))
            residual.copy_(h)
        if i == len(self.layers):
            self.normed[:size].copy_(normed[0])
            return
        q, k, v = self.layers[i].self_attn.project(normed)
        for part, x in zip(self.qkv[:size].split(self.widths, dim=-1), (q, k, v), strict=True):
            part.copy_(x.reshape(size, -1))

    def _step(self, size: int) -> None:
        """A whole step over the first `size` rows: the pieces with each layer's attention between them,
        reading the step's inputs from StepBuffers and writing straight into the attention buffer."""
        assert self.inputs is not None
        context, cos, sin = self.inputs.attention(size)
        heads = self.attn[:size].view(size, -1, self.head_size)  # [T, H, D]
        self._piece(0, size)
        for i in range(len(self.layers)):
            q, k, v = (x.view(1, size, -1, self.head_size) for x in self.qkv[:size].split(self.widths, dim=-1))
            context.attend(i, q, k, v, cos, sin, out=heads)
            self._piece(i + 1, size)

    def _norm_before(self, i: int) -> RMSNorm:
        return self.model.norm if i == len(self.layers) else self.layers[i].input_layernorm

    def _make(self, size: int) -> list[Callable[[], None]]:
        """Every piece of one bucket."""
        return self._captured([functools.partial(self._piece, i, size) for i in range(len(self.layers) + 1)])

    def _make_step(self, size: int) -> Callable[[], None]:
        """One bucket's whole step."""
        return self._captured([functools.partial(self._step, size)])[0]

    def _captured(self, calls: list[Callable[[], None]]) -> list[Callable[[], None]]:
        """Each call as a captured graph's replay, or as it is when capture is off. Either way each runs
        once now (eagerly, on a side stream as capture wants): kernels that compile or pick a
        configuration on their first call for a shape do it outside the graph. What it writes, the
        forward that follows rewrites (a step's K/V: the cleared inputs send them to the scratch block)."""
        if not self.capture:  # the same first run and its writes, so that a CPU test meets them too
            for call in calls:
                call()
            return calls
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for call in calls:
                call()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graphs = []
        for call in calls:
            graph = torch.cuda.CUDAGraph()
            with capture_graph(graph, self.pool):
                call()
            if self.pool is None:
                self.pool = graph.pool()
            graphs.append(graph)
        return [graph.replay for graph in graphs]
