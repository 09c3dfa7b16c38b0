"""Shared test helpers: operands drawn fresh, and the fp32 math every backend must match."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch

from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR
from fp8route.quant import FP8_DTYPE, FP8_MAX

# A kernel test that runs on a GPU, and on a CPU under Triton's interpreter (TRITON_INTERPRET=1).
GPU_OR_INTERPRETER = [
    pytest.mark.gpu,
    pytest.mark.interpreter,
    pytest.mark.skipif(
        TRITON_IMPORT_ERROR is not None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
        reason="needs triton, and CUDA or TRITON_INTERPRET=1",
    ),
]


def _cpu_scaled_mm_takes_rowwise_scales() -> bool:
    """Whether this torch's CPU _scaled_mm runs the rowwise backend's call (2.13 does; 2.11's takes
    per-tensor scales only)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


# A test that runs the rowwise backend on CPU tensors.
CPU_ROWWISE = pytest.mark.skipif(
    not _cpu_scaled_mm_takes_rowwise_scales(),
    reason=f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only (the rowwise backend runs here)",
)


def random_fp8_operands(m: int, n: int, k: int, device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w_scale = w.abs().max() / FP8_MAX
    x = torch.randn(m, k, generator=g)
    x_scale = x.abs().max() / FP8_MAX
    return {
        "x": x.to(device),
        "weight": (w / w_scale).to(FP8_DTYPE).to(device),
        "weight_scale": w_scale.to(device),
        "input_scale": x_scale.to(device),
        "bias": (torch.randn(n, generator=g) * 0.1).to(device),
    }


def fp32_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The layer's math written out on the same quantized operands, in fp32."""
    x_q = (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    out = (x_q.float() * input_scale) @ (weight.float() * weight_scale).t()
    return out if bias is None else out + bias.float()


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def poison_allocator(numel: int, device: str) -> None:
    """Fill a block with NaN and free it, so an output that reuses it and skips elements shows NaN."""
    block = torch.full((numel,), float("nan"), device=device)
    del block


def paged(
    dense: torch.Tensor, page: int, seed: int | None = 0, fill: float = float("nan")
) -> tuple[torch.Tensor, torch.Tensor]:
    """dense [B, Hkv, S, D] -> (blocks [1 + B * S / page, page, Hkv, D], tables [B + 1, S / page]): the
    rows' blocks in a shuffled order (seed), or in order (None). As in the engine's pool, block 0 is
    the scratch block (it holds `fill`) and the last table row the padding row (all block 0)."""
    b, hkv, s, d = dense.shape
    per_row = s // page
    if seed is None:
        order = torch.arange(1, 1 + b * per_row)
    else:
        order = torch.randperm(b * per_row, generator=torch.Generator().manual_seed(seed)) + 1
    blocks = torch.full((1 + b * per_row, page, hkv, d), fill, dtype=dense.dtype, device=dense.device)
    tables = torch.zeros(b + 1, per_row, dtype=torch.int32, device=dense.device)
    tables[:b] = order.view(b, per_row).to(dense.device, torch.int32)
    blocks[tables[:b].flatten().long()] = dense.permute(0, 2, 1, 3).reshape(b * per_row, page, hkv, d)
    return blocks, tables


def generate_with_logits(model, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """model.generate's tokens [B, T + n] and the logits each new token was chosen from [B, n, vocab]:
    the sampler's input at every step, for calls whose rows all sample at every step (prompts that
    one step prefills, no stop ids)."""
    from unittest import mock

    from fp8route.engine.sampler import Sampler

    seen: list[torch.Tensor] = []
    real = Sampler.__call__

    def recording(self, logits: torch.Tensor, *rest):  # type: ignore[no-untyped-def]
        seen.append(logits.float().clone())
        return real(self, logits, *rest)

    with mock.patch.object(Sampler, "__call__", recording):
        tokens = model.generate(*args, **kwargs)
    return tokens, torch.stack(seen, dim=1)


def greedy_continuation(model, ids: torch.Tensor, n: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """ids [B, T] continued greedily by n tokens with model's full forward, no cache: [B, T + n], the
    independent reference the engine's tokens are held to."""
    seq = ids
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


def build_lm(
    cfg: Any, linears: Mapping[str, torch.nn.Module], tensors: Mapping[str, torch.Tensor], config: Any, **engine: Any
) -> Any:
    """load_model's handle over in-memory parts: a plain model, its engine (config; engine: LLMEngine's
    keyword arguments) and the CausalLM over them, quietly."""
    from fp8route.engine import CausalLM
    from fp8route.engine.llm_engine import LLMEngine
    from fp8route.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(cfg, linears, tensors)
    return CausalLM(LLMEngine(config, model, quiet=True, **engine))


def run_arrivals(
    engine: Any, prompts: Sequence[list[int]], params: Callable[[int], Any], arrivals: Sequence[tuple[int, int]]
) -> list[tuple[list[int], list[Any]]]:
    """The prompts (index, step it arrives at) added to one engine in that order, each at its step with
    params(index), the engine stepped until all finish: each request's tokens and logprobs, by index."""
    requests, step, waiting = {}, 0, list(arrivals)
    while waiting or engine.has_unfinished:
        while waiting and waiting[0][1] <= step:
            i, _ = waiting.pop(0)
            requests[i] = engine.add_request(prompts[i], params(i), request_id=f"r{i}")
        engine.step()
        step += 1
    return [(list(requests[i].output_token_ids), list(requests[i].logprobs)) for i in sorted(requests)]
