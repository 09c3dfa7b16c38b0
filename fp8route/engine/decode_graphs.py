"""CUDA graphs of the decode step, one per batch-size bucket, captured on first use.

At decode sizes a step is hundreds of small kernels whose launches cost more host time than the
GPU needs to run them; a graph replays them all with one launch. A graph has fixed shapes and
addresses, so each bucket gets one static buffer for the step's inputs (token ids, whether each
comes from the device, positions, table rows), written before each replay by one copy from pinned
host memory: a batch of B runs in the smallest bucket >= B, its extra rows padded on the host to
read and write only the scratch block (table row `pad_row`, position 0), so no kernel runs outside
the graph.

A graph replays the kernels, operands and workspaces it captured: when any Fp8Linear is replanned
(its prepared operands rebuilt) the graphs are dropped and captured again on the next step.

Programmatic dependent launch (fp8route.kernels.pdl) overlaps each kernel's start with the tail of
the one before: a gain where a step is many short kernels, a loss where the early blocks hold an SM
that the kernel before still needs (which wins where: docs/engine.md). So where the engine
leaves it to measurement (EngineConfig.pdl None), each bucket is captured twice, without and with it,
their replays timed in turn, and the faster graph kept (`pdl_choices` says which and by how much).
"""

from __future__ import annotations

import bisect
import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fp8route.device import capture_graph
from fp8route.kernels.options import capturing_with, kernel_options
from fp8route.linear.layer import plans_epoch

log = logging.getLogger(__name__)

StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (ids, pending, positions, rows) -> (logits, argmax)
INPUTS = 4  # a step's inputs: ids, pending, positions, rows
# PDL is kept only where its replays beat the plain ones by more than this share: closer than that,
# the choice would follow the replays' spread from one start to the next.
PDL_MARGIN = 0.01
TIMED_REPLAYS = 8  # of each graph, in turn, after one untimed replay each


def buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... 32, then every 32 up to max_batch_size, and max_batch_size itself: a batch
    pads to at most 2x below 32 rows and to 32 rows more above (decode is weight-bound there)."""
    sizes, size = [], 1
    while size < min(max_batch_size, 32):
        sizes.append(size)
        size *= 2
    size = 32
    while size < max_batch_size:
        sizes.append(size)
        size += 32
    return [*sizes, max_batch_size]


def padded_inputs(host: np.ndarray, size: int, pad_row: int) -> np.ndarray:
    """A step's inputs [4, B] padded to a bucket of size rows, [4, size rounded up to even]: each
    padding row takes token 0 from the host at position 0 of table row pad_row. The width keeps each
    input's row 16 bytes aligned, as Triton specializes a kernel on its pointers' alignment."""
    b = host.shape[1]
    padded = np.zeros((INPUTS, size + size % 2), dtype=np.int64)
    padded[:, :b] = host
    padded[INPUTS - 1, b:] = pad_row
    return padded


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [4, width] int64 (padded_inputs' layout), read by the graph
    logits: torch.Tensor  # [bucket, vocab], written by the graph
    next_tokens: torch.Tensor  # [bucket] int64 greedy argmax, written by the graph


@dataclass(frozen=True)
class PdlChoice:
    """One bucket's graph replay times, medians in ms, without PDL and with it."""

    off_ms: float
    on_ms: float

    @property
    def pdl(self) -> bool:
        """Whether the graph with PDL is the one kept."""
        return self.on_ms < self.off_ms * (1 - PDL_MARGIN)

    def __str__(self) -> str:
        return f"PDL {'on' if self.pdl else 'off'} ({self.on_ms:.3f} ms a replay with it, {self.off_ms:.3f} without)"


class DecodeGraphs:
    """Runs step(ids, pending, positions, rows; each [B] on the device) -> (logits [B, vocab], argmax
    [B]) from CUDA graphs, given the inputs on the host ([4, B], runner.decode_inputs' layout)."""

    def __init__(
        self, step: StepFn, max_batch_size: int, pad_row: int, device: torch.device, measure_pdl: bool = False
    ) -> None:
        """measure_pdl: capture each bucket without and with PDL and keep the faster (the caller checked
        why_not_pdl); unless the kernel options already launch everything with it."""
        self.step, self.pad_row, self.device = step, pad_row, device
        self.measure_pdl = measure_pdl
        self.sizes = buckets(max_batch_size)
        self.graphs: dict[int, _Captured] = {}
        self.pdl_choices: dict[int, PdlChoice] = {}  # by bucket, where measured
        self.pool: Any = None  # one memory pool shared by every bucket's graph
        self.epoch = plans_epoch()

    def bucket(self, batch: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, batch)]

    def pdl_note(self) -> str:
        """Which measured buckets kept PDL, in words ("" where none was measured)."""
        if not self.pdl_choices:
            return ""
        kept = [str(size) for size, choice in sorted(self.pdl_choices.items()) if choice.pdl]
        rows = f" (batches of {', '.join(kept)})" if kept else ""
        return f"PDL measured faster in {len(kept)} of {len(self.pdl_choices)} decode graphs{rows}"

    def drop(self) -> None:
        self.graphs.clear()
        self.pdl_choices.clear()
        self.pool = None

    def run(self, host: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        if self.epoch != plans_epoch():
            self.drop()
            self.epoch = plans_epoch()
        b = host.shape[1]
        size = self.bucket(b)
        # Pinned, so the copy leaves the host free; it waits on the stream for the last replay.
        staged = torch.from_numpy(padded_inputs(host, size, self.pad_row)).pin_memory()
        captured = self.graphs.get(size)
        if captured is None:
            captured = self.graphs[size] = self._capture(size, staged)
        else:
            captured.inputs.copy_(staged, non_blocking=True)
        captured.graph.replay()
        return captured.logits[:b], captured.next_tokens[:b]

    def _capture(self, size: int, staged: torch.Tensor) -> _Captured:
        if not self.measure_pdl or kernel_options().pdl:
            return self._capture_one(size, staged)
        captured = []
        for pdl in (False, True):
            with capturing_with(pdl=pdl):
                captured.append(self._capture_one(size, staged))
        off, on = captured
        choice = self.pdl_choices[size] = PdlChoice(*replay_ms([off.graph, on.graph], self.device))
        log.info("decode graph of %d rows: %s", size, choice)
        return on if choice.pdl else off

    def _capture_one(self, size: int, staged: torch.Tensor) -> _Captured:
        # An ordinary tensor even when captured under inference_mode: a later step outside it writes it.
        with torch.inference_mode(False):
            static = staged.to(self.device)
        inputs = static[:, :size].unbind()
        # One eager step first, on a side stream as capture wants: kernels that compile or pick a
        # configuration on their first call for a shape (Triton, fp8_gemv) do it here, outside the
        # graph. It writes the same K/V the replay that follows writes, so it changes nothing.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.step(*inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capture_graph(graph, self.pool):
            logits, next_tokens = self.step(*inputs)
        if self.pool is None:
            self.pool = graph.pool()
        return _Captured(graph, static, logits, next_tokens)


def replay_ms(graphs: Sequence[torch.cuda.CUDAGraph], device: torch.device) -> list[float]:
    """Each graph's median replay time in ms, the graphs replayed in turn (so a clock or a neighbour
    that drifts meets each alike). A decode graph's replays write the same K/V each time."""
    for graph in graphs:
        graph.replay()
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(2 * TIMED_REPLAYS)] for _ in graphs]
    for i in range(TIMED_REPLAYS):
        for graph, marks in zip(graphs, events, strict=True):
            marks[2 * i].record()
            graph.replay()
            marks[2 * i + 1].record()
    torch.cuda.synchronize(device)
    return [statistics.median(m[2 * i].elapsed_time(m[2 * i + 1]) for i in range(TIMED_REPLAYS)) for m in events]
