"""The one loader: a checkpoint -> the plain model the engine runs and evaluation scores, FP8 or not.

`load_weights` reads what every caller needs (the model, its device, EOS ids, the FP8 KV cache's
scales, how a rank shares it); the engine (fp8route.engine.llm_engine), `load_model`, `LLM`, the
server, `bench` and `eval` all load through it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from fp8route.checkpoint.formats import CONFIG, read_json
from fp8route.checkpoint.hub import resolve_model_path
from fp8route.engine.config import EngineConfig
from fp8route.engine.flashinfer_attention import check_attention
from fp8route.engine.kv_quant import KVScales, kv_scales_for
from fp8route.linear.policy import Policy
from fp8route.loading import load_parts
from fp8route.models.llama import LlamaForCausalLM
from fp8route.progress import TextProgress


def resolve_model(model: str | os.PathLike[str]) -> Path:
    """A checkpoint folder, a repository id in the local Hugging Face hub cache, or a name of the
    packaged SmolLM2-135M-Instruct: `smollm2` (FP8 per tensor), `smollm2-channel`, `smollm2-block`
    or `smollm2-bf16` (fp8route.checkpoint.smollm2.NAMES)."""
    if str(model).startswith("smollm2"):  # the module is imported only where a name may need it
        from fp8route.checkpoint import smollm2

        if str(model) in smollm2.NAMES:
            return smollm2.named_folder(str(model), TextProgress(f"preparing {model}"))
    folder = resolve_model_path(model)
    read_json(folder / CONFIG)  # a folder that is not there, or holds no config.json, is named as such first
    return folder


def eos_token_ids(config: dict[str, Any]) -> list[int]:
    value = config.get("eos_token_id")
    return [value] if isinstance(value, int) else [v for v in value or [] if isinstance(v, int)]


@dataclass
class LoadedModel:
    """A checkpoint, loaded: the plain model (weights and the forward, no runtime state) and what the
    engine needs besides."""

    model: LlamaForCausalLM
    folder: Path
    device: torch.device
    eos_token_ids: list[int]
    kv_scales: KVScales | None  # the FP8 KV cache's per-layer scales (None: the cache in dtype)
    parallel: str | None  # how this rank shares the model, when it is sharded


def load_weights(
    path: str | os.PathLike[str],
    config: EngineConfig,
    policy: Policy | None = None,
) -> LoadedModel:
    """A Llama-family model (Llama, Mistral, Qwen2, Qwen3) from a checkpoint folder, a Hugging Face
    repository id ("org/name") in the local hub cache, or `smollm2`, as config says (its device,
    dtype, kv_cache_dtype, attention, all_reduce, tp_lm_head, pdl, quantize_upstream): config.json checked
    against the tensors' header shapes before any weight is read, FP8 linears planned by policy,
    float tensors in the config's dtype. Under torch.distributed (more than one
    rank) each rank reads its slices of the checkpoint (fp8route.models.parallel)."""
    config.apply_kernel_options()  # before any plan or graph is made with the options before them
    if config.deterministic:
        config.check_deterministic()
        policy = replace(policy or Policy.from_env(), deterministic=True)
    folder = resolve_model(path)
    eos = eos_token_ids(read_json(folder / CONFIG))
    parts = load_parts(
        folder, config.device, dtype=config.torch_dtype, policy=policy, all_reduce=config.all_reduce,
        tp_lm_head=config.tp_lm_head,
        before_weights=lambda target: check_attention(config.attention, target),
    )  # fmt: skip
    layers = parts.cfg.num_hidden_layers
    scales = kv_scales_for(config.kv_cache_dtype, parts.kv_scales, layers, str(folder), parts.kv_scheme)
    model = LlamaForCausalLM(parts.cfg, parts.linears, parts.tensors, batch_invariant=config.deterministic)
    return LoadedModel(model.eval(), folder, parts.device, eos, scales, parts.parallel)
