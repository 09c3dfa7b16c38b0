"""A checkpoint folder -> the Llama-family model's parts (config, linears, tensors), FP8 or not.

It stands above both things it joins: fp8route.models (the model definition and its sharding,
which imports nothing of fp8route.checkpoint) and fp8route.checkpoint (reading and writing
folders, over the model definition). FP8 checkpoints (ModelOpt, compressed-tensors, quant_method
fp8; per tensor, per channel or in 128x128 blocks) load through load_checkpoint, their linears
routed for this GPU; plain bf16/fp16/fp32 Hugging Face checkpoints (read_plain) run unquantized,
as the baseline the FP8 model is compared against.
Either way the float tensors end up in dtype. Under torch.distributed each rank gets its shard
(fp8route.models.parallel). What runs them (KV pool, decode graphs, the serving engine) is
fp8route.engine.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fp8route.checkpoint.formats import CONFIG, read_json
from fp8route.checkpoint.hub import resolve_model_path
from fp8route.checkpoint.load import Checkpoint, is_quantized, load_checkpoint, read_plain
from fp8route.device import default_device
from fp8route.errors import Fp8InputError
from fp8route.linear.policy import Policy
from fp8route.models.collectives import ONE_SHOT_BYTES, AllReduce, check_method
from fp8route.models.llama import LlamaConfig, LlamaForCausalLM
from fp8route.models.parallel import (
    LmHead,
    Shard,
    Slicer,
    check_lm_head,
    init_from_env,
    local_config,
    wrap_layers,
)
from fp8route.quant import FLOAT_DTYPES


@dataclass
class ModelParts:
    """What a model is built from: its (local, when sharded) config, FP8 linears and other tensors."""

    cfg: LlamaConfig
    linears: dict[str, nn.Module]
    tensors: dict[str, torch.Tensor]
    device: torch.device
    parallel: str | None  # how this rank shares the model, when it is sharded
    kv_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # Checkpoint.kv_scales (FP8 KV cache)
    kv_scheme: str | None = None  # what the quantization config says of the KV cache ("FP8" or None)


def load_parts(
    path: str | os.PathLike[str],
    device: str | torch.device | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    policy: Policy | None = None,
    all_reduce: str = "nccl",
    tp_lm_head: LmHead = "vocab",
    before_weights: Callable[[torch.device], None] | None = None,
) -> ModelParts:
    """Read a Llama-family checkpoint folder, or a Hugging Face repository id ("org/name") in the
    local hub cache (fp8route.checkpoint.hub.resolve_model_path), onto device (default: CUDA when
    available): config.json checked against the tensors' header shapes (layers, sizes, heads,
    vocabulary, tied embeddings) before any weight is read, FP8 linears planned by policy, float
    tensors in dtype; sharded over the default process group when there is one (tp_lm_head and
    all_reduce as load_model takes them). before_weights(device) runs once the config is read and
    the device known, before any weight is: a caller's checks."""
    if dtype not in FLOAT_DTYPES:
        raise Fp8InputError(f"load_model: dtype must be bfloat16, float16 or float32, got {dtype}")
    check_lm_head(tp_lm_head)
    check_method(all_reduce)
    folder = resolve_model_path(path)
    config = read_json(folder / CONFIG)
    cfg = LlamaConfig.from_hf(config, CONFIG)
    target = init_from_env(device) or default_device(device)
    if before_weights is not None:
        before_weights(target)
    shard = Shard.current()
    slicer = None if shard is None else Slicer.of(cfg, shard, tp_lm_head)
    kv_scales: dict[str, torch.Tensor] = {}
    kv_scheme = None
    if is_quantized(folder, config):
        checkpoint = load_checkpoint(folder, target, policy=policy, slices=slicer)
        linears: dict[str, nn.Module] = dict(checkpoint.linears)
        tensors = {n: t.to(dtype) if t.is_floating_point() else t for n, t in checkpoint.tensors.items()}
        kv_scales, kv_scheme = checkpoint.kv_scales, checkpoint.scheme.kv_cache
    else:
        linears, tensors = {}, read_plain(folder, target, dtype, slicer)
    parallel = None
    if slicer is not None and shard is not None:
        reduce = AllReduce(target, dtype, ONE_SHOT_BYTES, all_reduce, width=cfg.hidden_size)
        linears, tensors = wrap_layers(linears, tensors, slicer, reduce)
        cfg = local_config(cfg, slicer.shard.size)
        parallel = f"tensor parallel rank {shard.rank} of {shard.size}; all-reduce {reduce.describe()}"
    return ModelParts(cfg, linears, tensors, target, parallel, kv_scales, kv_scheme)


def model_from_checkpoint(checkpoint: Checkpoint) -> LlamaForCausalLM:
    """The full-forward model over a loaded Checkpoint: its Fp8Linears and its plain tensors."""
    return LlamaForCausalLM(LlamaConfig.from_hf(checkpoint.config), checkpoint.linears, checkpoint.tensors)
