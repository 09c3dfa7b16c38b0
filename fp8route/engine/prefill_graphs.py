"""A packed prefill forward replayed from CUDA graphs in pieces: everything but the attention.

An eager prefill issues some 15 kernels a layer through Python: host time that does not shrink
with the token count and, for a mixed step of moderate size, is longer than the GPU's own (the
runs that show it: docs/results.md). The attention between the pieces depends on how the tokens split
into sequences and where each sits in the cache, so it stays eager; the rest of a layer (o_proj,
the residual adds and norms, the MLP, the next layer's q/k/v projections) depends only on the
token count. So each token-count bucket gets one graph per gap between attentions: the first
takes the embeddings to layer 0's q/k/v, each next one takes an attention's output to the next
layer's q/k/v, the last ends at the final norm.

Pieces talk through static buffers sized for the largest bucket. T tokens run in the smallest
bucket >= T; the rows past T are zero before every forward, and every linear's input stays zero
there (a zero row normalizes to zero, the attention writes only real rows), so a dynamic
per-tensor input scale sees the same amax as the eager forward. A replanned Fp8Linear drops the
graphs, as it drops the decode graphs.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from fp8route.linear.layer import plans_epoch

if TYPE_CHECKING:
    from fp8route.models.llama import AttentionContext, DecoderLayer, LlamaModel, RMSNorm

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


class PrefillGraphs:
    """Runs LlamaModel.run_layers over a packed prefill from captured pieces. capture=False runs the
    same pieces eagerly over the same padded buffers (what a CPU can test)."""

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
        self.used = top  # rows the last forward's pieces wrote: those past the next one's tokens are zeroed
        self.pieces: dict[int, list[Callable[[], None]]] = {}
        self.pool: Any = None  # the memory pool every piece's graph shares
        self.epoch = plans_epoch()

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def bucket(self, tokens: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, tokens)]

    def capture_all(self) -> None:
        """Every bucket's pieces now, so that no request waits for a capture."""
        self._check_epoch()
        for size in self.sizes:
            if size not in self.pieces:
                self.pieces[size] = self._make(size)

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: AttentionContext) -> torch.Tensor:
        """h [T, hidden] (embeddings; T <= max_tokens) -> the final norm's output [T, hidden]; the
        attention of each layer runs eagerly through context, as in run_layers."""
        self._check_epoch()
        t = h.shape[0]
        size = self.bucket(t)
        pieces = self.pieces.get(size)
        if pieces is None:
            pieces = self.pieces[size] = self._make(size)
        if self.used > t:
            self.residual[t : self.used].zero_()
            self.attn[t : self.used].zero_()
        self.used = size
        self.residual[:t].copy_(h)
        pieces[0]()
        heads = self.attn.view(1, self.attn.shape[0], -1, self.head_size).transpose(1, 2)  # [1, H, top, D]
        for i in range(len(self.layers)):
            q, k, v = (x.view(1, t, -1, self.head_size) for x in self.qkv[:t].split(self.widths, dim=-1))
            heads[:, :, :t].copy_(context.attend(i, q, k, v, cos, sin))
            pieces[i + 1]()
        return self.normed[:t]

    def _check_epoch(self) -> None:
        """Drop every piece when an Fp8Linear was replanned since they were captured."""
        if self.epoch != plans_epoch():
            self.pieces.clear()
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

    def _norm_before(self, i: int) -> RMSNorm:
        return self.model.norm if i == len(self.layers) else self.layers[i].input_layernorm

    def _make(self, size: int) -> list[Callable[[], None]]:
        """Every piece of one bucket: captured graphs' replays, or eager calls when capture is off."""
        count = len(self.layers) + 1
        if not self.capture:
            return [functools.partial(self._piece, i, size) for i in range(count)]
        # Each piece runs once eagerly first, on a side stream as capture wants: kernels that compile
        # or pick a configuration on their first call for a shape do it outside the graph. The
        # buffers it writes are rewritten by the forward that follows.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for i in range(count):
                self._piece(i, size)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graphs = []
        for i in range(count):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._piece(i, size)
            if self.pool is None:
                self.pool = graph.pool()
            graphs.append(graph)
        return [graph.replay for graph in graphs]
