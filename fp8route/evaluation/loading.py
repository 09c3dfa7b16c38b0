"""Load a checkpoint folder for evaluation: the built-in Llama runner and the folder's tokenizer.

Either kind of folder works: an FP8 one of any scheme and format load_checkpoint reads (its
linears Fp8Linears) or a plain bf16/fp16 Hugging Face one, so the
two can be scored side by side on the same token ids.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from fp8route.checkpoint.formats import CONFIG, read_json
from fp8route.engine.config import DTYPES, EngineConfig
from fp8route.engine.kv_quant import KVScales, RoundTripAttention
from fp8route.engine.load import load_weights, resolve_model
from fp8route.linear.plan import fallback_lines
from fp8route.linear.policy import Policy
from fp8route.models.llama import LlamaForCausalLM
from fp8route.models.tokenizer import load_tokenizer


class _RoundTripKV(torch.nn.Module):
    """The full forward with K/V rounded through an fp8 cache (fp8route.engine.kv_quant.RoundTripAttention)."""

    def __init__(self, model: LlamaForCausalLM, scales: KVScales, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.model, self.context, self.dtype = model, RoundTripAttention(scales), dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.logits(input_ids, self.dtype, self.context)


def load_for_eval(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    policy: Policy | None = None,
    kv_cache_dtype: str = "auto",
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Any]:
    """(model, tokenizer) for a checkpoint folder, a repository id in the Hugging Face hub cache, or smollm2,
    read by the engine's loader (fp8route.engine.load.load_weights) without an engine: `model(input_ids[B, T])
    -> logits[B, T, V]`, computed in dtype (None: the checkpoint's torch_dtype, bf16 when it names none).
    FP8 layers quantize their inputs to FP8 whatever dtype the activations are carried in; policy (e.g. a
    forced backend) plans them, FP8ROUTE_* from the environment when None. kv_cache_dtype "fp8" rounds every
    layer's K and V through e4m3 with the checkpoint's scales (1.0 and a warning without), as an fp8 KV cache
    gives them back (fp8route.engine.kv_quant.RoundTripAttention)."""
    folder = resolve_model(path)
    dtype = dtype or _stored_dtype(read_json(folder / CONFIG))
    name = str(dtype).removeprefix("torch.")
    config = EngineConfig(model=str(folder), device=str(device), dtype=name, kv_cache_dtype=kv_cache_dtype)
    loaded = load_weights(folder, config, policy)
    tokenizer = load_tokenizer(folder)
    if loaded.kv_scales is not None:
        return _RoundTripKV(loaded.model, loaded.kv_scales, dtype).eval(), tokenizer
    return functools.partial(loaded.model, dtype=dtype), tokenizer


def _stored_dtype(config: dict[str, Any]) -> torch.dtype:
    """The float dtype config.json says the checkpoint holds (torch_dtype, or transformers' newer dtype)."""
    name = config.get("torch_dtype", config.get("dtype"))
    return DTYPES.get(name, torch.bfloat16) if isinstance(name, str) else torch.bfloat16


def routes(model: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """Which backends a loaded model's FP8 layers are planned to run, and every distinct fallback."""
    from fp8route.linear.layer import Fp8Linear

    module = model.func if isinstance(model, functools.partial) else model
    if not isinstance(module, torch.nn.Module):
        return {"backends": [], "fallbacks": []}
    plans = [m.plan for m in module.modules() if isinstance(m, Fp8Linear)]
    backends = sorted({b.name for plan in plans for b in plan.backends})
    fallbacks = sorted({line for plan in plans for line in fallback_lines(plan.fallbacks)})
    return {"backends": backends, "fallbacks": fallbacks}
