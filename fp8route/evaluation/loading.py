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
from fp8route.checkpoint.load import is_quantized, load_checkpoint, read_plain
from fp8route.engine.config import check_setting
from fp8route.engine.kv_quant import KVScales, RoundTripAttention, kv_scales_for
from fp8route.engine.load import resolve_model
from fp8route.linear.plan import fallback_lines
from fp8route.linear.policy import Policy
from fp8route.loading import model_from_checkpoint
from fp8route.models.llama import LlamaConfig, LlamaForCausalLM
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
    """(model, tokenizer) for a checkpoint folder, a repository id in the Hugging Face hub cache, or smollm2:
    `model(input_ids[B, T]) -> logits[B, T, V]`,
    computed in dtype (None: the embedding's, bf16 for these folders). FP8 layers quantize their
    inputs to FP8 whatever dtype the activations are carried in; policy (e.g. a forced backend)
    plans them, FP8ROUTE_* from the environment when None. kv_cache_dtype "fp8" rounds every
    layer's K and V through e4m3 with the checkpoint's scales (1.0 and a warning without), as an
    fp8 KV cache gives them back (fp8route.engine.kv_quant.RoundTripAttention)."""
    check_setting("kv_cache_dtype", kv_cache_dtype)
    folder = resolve_model(path)
    config = read_json(folder / CONFIG)
    tokenizer = load_tokenizer(folder)
    device = torch.device(device)
    kv_scales: dict[str, torch.Tensor] = {}
    scheme = None
    if is_quantized(folder, config):
        checkpoint = load_checkpoint(folder, device, policy=policy)
        model = model_from_checkpoint(checkpoint)
        kv_scales, scheme = checkpoint.kv_scales, checkpoint.scheme.kv_cache
    else:
        model = LlamaForCausalLM(LlamaConfig.from_hf(config), {}, read_plain(folder, device, None))
    model.eval()
    scales = kv_scales_for(kv_cache_dtype, kv_scales, model.cfg.num_hidden_layers, str(folder), scheme)
    if scales is not None:
        return _RoundTripKV(model, scales, dtype).eval(), tokenizer
    return (model if dtype is None else functools.partial(model, dtype=dtype)), tokenizer


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
