"""Reading the next GEMM's weight into L2 while a decode step runs the kernels between GEMMs.

A batch-1 decode step alternates weight-bound GEMMs with small kernels (norms, RoPE, attention,
all-reduces) during which the memory bus sits idle. Captured into the step's CUDA graph, each GEMM
is followed on a side stream by a kernel that reads the first `budget` bytes of the next GEMM's
weight, so those bytes are in L2 when that GEMM starts; the GEMMs themselves are unchanged. The
side stream joins the step at its end; nothing waits on a prefetch, and a prefetch computes nothing
that is used (a read whose result is stored only where no caller looks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fp8route.backends.kernels.launcher import DirectLauncher
from fp8route.backends.kernels.triton_support import TRITON_IMPORT_ERROR, tl, triton

_BLOCK = 8192  # 32-bit words each program reads: 32 KiB


def gemm_order(model: nn.Module) -> list[nn.Module]:
    """The modules whose weights a Llama-family decode step reads, in the order it reads them:
    per layer q/k/v (or qkv), o, gate/up (or gate_up), down; then lm_head. Wrappers that add a
    collective (RowParallel, VocabParallelHead) are looked through to the linear that holds the weight."""
    order: list[nn.Module] = []
    for layer in model.model.layers:  # type: ignore[union-attr]
        attn, mlp = layer.self_attn, layer.mlp
        order += [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
        order.append(attn.o_proj)
        order += [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
        order.append(mlp.down_proj)
    order.append(model.lm_head)  # type: ignore[arg-type]
    return [_innermost(m) for m in order]


def _weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _innermost(module: nn.Module) -> nn.Module:
    while not isinstance(getattr(module, "weight", None), torch.Tensor) and hasattr(module, "linear"):
        module = module.linear  # type: ignore[assignment]
    return module


class WeightPrefetch:
    """Prefetches of up to `budget` bytes of each GEMM's weight, issued while a decode step is
    captured into a CUDA graph (eager steps run without them)."""

    def __init__(self, model: nn.Module, budget: int, device: torch.device) -> None:
        self.budget = budget
        self.gemms = gemm_order(model)
        self.device = device
        self._side: torch.cuda.Stream | None = None
        self._sink: torch.Tensor | None = None
        self.issued = 0  # prefetches put into the graphs captured so far

    @property
    def active(self) -> bool:
        return self.budget > 0 and self.device.type == "cuda" and TRITON_IMPORT_ERROR is None

    @contextmanager
    def around_step(self) -> Iterator[None]:
        """Around one decode step: while it is being captured, each GEMM is followed by the
        next one's prefetch on the side stream, which the step's stream waits for at the end."""
        if not self.active:
            yield
            return
        if not torch.cuda.is_current_stream_capturing():
            self._prepare()  # the eager step before a capture: outside it, where compiling is safe
            yield
            return
        if self._side is None:
            raise RuntimeError("WeightPrefetch: run the step once outside CUDA-graph capture first")
        main = torch.cuda.current_stream(self.device)
        handles = [gemm.register_forward_hook(self._hook(_weight(nxt))) for gemm, nxt in zip(self.gemms, self.gemms[1:])]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            main.wait_stream(self._side)

    def _prepare(self) -> None:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
            self._sink = torch.zeros(1, dtype=torch.int32, device=self.device)
            touch(self._sink, self._sink)  # compiles the kernel

    def _hook(self, weight: torch.Tensor) -> Callable[[nn.Module, object, object], None]:
        words = min(self.budget, weight.numel() * weight.element_size()) // 4
        flat = weight.reshape(-1).view(torch.int32)[:words] if weight.is_contiguous() else None

        def hook(module: nn.Module, args: object, out: object) -> None:
            if flat is None or words == 0:
                return
            assert self._side is not None and self._sink is not None  # _prepare ran (around_step)
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                touch(flat, self._sink)
            self.issued += 1

        return hook


def touch(words: torch.Tensor, sink: torch.Tensor) -> None:
    """Read every 32-bit word of `words` (a contiguous int32 tensor) through L2."""
    n = words.numel()
    _TOUCH((triton.cdiv(n, _BLOCK),), (n,), (words, sink, n), _TOUCH_META)


if triton is not None:

    @triton.jit
    def _touch_kernel(src_ptr, sink_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        words = tl.load(src_ptr + offs, mask=offs < n, other=0, cache_modifier=".cg")
        # A store the compiler cannot drop, almost never taken (all four bytes 0x7f: NaNs in
        # e4m3): the reads are the point, and a taken store only writes the sink.
        top = tl.max(words, axis=0)
        if top == 0x7F7F7F7F:
            tl.store(sink_ptr, top)

    _TOUCH = DirectLauncher(_touch_kernel, pointers=2)
    _TOUCH_META = {"BLOCK": _BLOCK, "num_warps": 8}
