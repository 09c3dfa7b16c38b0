"""CUDA graphs of the decode step, one per batch-size bucket, captured on first use.

At decode sizes a step is hundreds of small kernels whose launches cost more host time than
the GPU needs to run them; a graph replays them all with one launch. A graph has fixed shapes
and addresses, so each bucket (1, 2, 4, 8, ... up to max_batch_size) gets static token and
position buffers that the caller's values are copied into before each replay; a batch of B
runs in the smallest bucket >= B, its extra rows working on rows of the KV cache that this
batch does not use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

StepFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def buckets(max_batch_size: int) -> list[int]:
    """Powers of two below max_batch_size, then max_batch_size itself."""
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch_size]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [bucket] int64, read by the graph
    positions: torch.Tensor  # [bucket] int64, read by the graph
    logits: torch.Tensor  # [bucket, vocab], written by the graph
    next_tokens: torch.Tensor  # [bucket] int64 greedy argmax, written by the graph


class DecodeGraphs:
    """Runs step(tokens [B], positions [B]) -> (logits [B, vocab], argmax [B]) from CUDA graphs."""

    def __init__(self, step: StepFn, max_batch_size: int, device: torch.device) -> None:
        self.step, self.device = step, device
        self.sizes = buckets(max_batch_size)
        self.graphs: dict[int, _Captured] = {}
        self.pool: Any = None  # one memory pool shared by every bucket's graph

    def bucket(self, batch: int) -> int:
        return next(size for size in self.sizes if size >= batch)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = tokens.shape[0]
        size = self.bucket(b)
        captured = self.graphs.get(size)
        if captured is None:
            captured = self.graphs[size] = self._capture(size, tokens, positions)
        else:
            captured.tokens[:b].copy_(tokens)
            captured.positions[:b].copy_(positions)
        captured.graph.replay()
        return captured.logits[:b], captured.next_tokens[:b]

    def _capture(self, size: int, tokens: torch.Tensor, positions: torch.Tensor) -> _Captured:
        b = tokens.shape[0]
        static_tokens = torch.zeros(size, dtype=torch.int64, device=self.device)
        static_positions = torch.zeros(size, dtype=torch.int64, device=self.device)
        static_tokens[:b].copy_(tokens)
        static_positions[:b].copy_(positions)
        # One eager step first, on a side stream as capture wants: kernels that compile or pick a
        # configuration on their first call for a shape (Triton, fp8_gemv) do it here, outside the
        # graph. It writes the same K/V the replay that follows writes, so it changes nothing.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.step(static_tokens, static_positions)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, next_tokens = self.step(static_tokens, static_positions)
        if self.pool is None:
            self.pool = graph.pool()
        return _Captured(graph, static_tokens, static_positions, logits, next_tokens)
