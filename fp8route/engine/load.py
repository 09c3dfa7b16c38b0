"""load_model: a checkpoint -> a CausalLM with its engine, FP8 or not."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fp8route.checkpoint.formats import CONFIG, read_json
from fp8route.checkpoint.hub import resolve_model_path
from fp8route.engine.causal_lm import CausalLM
from fp8route.engine.config import EngineConfig
from fp8route.engine.flashinfer_attention import check_attention
from fp8route.engine.kv_quant import kv_scales_for
from fp8route.linear.policy import Policy
from fp8route.loading import load_parts
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


def load_model(
    path: str | os.PathLike[str],
    *,
    policy: Policy | None = None,
    config: EngineConfig | None = None,
    quiet: bool = False,
    **settings: Any,
) -> CausalLM:
    """A Llama-family model (Llama, Mistral, Qwen2, Qwen3) and its engine from a checkpoint folder, a
    Hugging Face repository id ("org/name") in the local hub cache, or `smollm2`. Settings are
    EngineConfig's fields (config, then keyword arguments over it): device defaults to CUDA when
    available, dtype to bfloat16 for every float tensor (FP8 linears stay FP8, planned by policy).
    config.json is checked against the tensors' header shapes before any weight is read.

    Under torch.distributed (more than one rank) each rank reads its slices of the checkpoint
    (fp8route.models.parallel); tp_lm_head="vocab" splits lm_head over the vocabulary and gathers
    the logits, "replicated" keeps a whole lm_head on every rank; all_reduce picks how row-parallel
    outputs are summed (fp8route.models.collectives.METHODS). Every rank returns full logits.
    kv_cache_dtype="fp8" keeps the KV cache in float8_e4m3fn with the checkpoint's per-layer K/V
    scales (1.0 and a warning when it has none; fp8route.engine.kv_quant). pdl and silu_in_down set
    the process's kernel options (fp8route.set_kernel_options) when given."""
    config = (config or EngineConfig()).replace(model=str(path), **settings)
    config.apply_kernel_options()  # before any plan or graph is made with the options before them
    folder = resolve_model(path)
    eos = eos_token_ids(read_json(folder / CONFIG))
    parts = load_parts(
        folder, config.device, dtype=config.torch_dtype, policy=policy, all_reduce=config.all_reduce,
        tp_lm_head=config.tp_lm_head,  # type: ignore[arg-type]
        before_weights=lambda target: check_attention(config.attention, target),
    )  # fmt: skip
    if parts.device.type == "cpu":
        config.use_cpu_threads()
    layers = parts.cfg.num_hidden_layers
    scales = kv_scales_for(config.kv_cache_dtype, parts.kv_scales, layers, str(folder), parts.kv_scheme)
    model = CausalLM(
        parts.cfg, parts.linears, parts.tensors, config, device=parts.device, kv_scales=scales, eos_token_ids=eos,
        quiet=quiet,
    )  # fmt: skip
    model.parallel = parts.parallel
    return model
