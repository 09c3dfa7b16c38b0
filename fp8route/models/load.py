"""load_model: a checkpoint folder -> a CausalLM ready to generate, FP8 or not.

Per-tensor FP8 checkpoints (ModelOpt, compressed-tensors) load through load_checkpoint, their
linears routed for this GPU; plain bf16/fp16/fp32 Hugging Face checkpoints run unquantized, as
the baseline the FP8 model is compared against. Either way the float tensors end up in dtype.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from fp8route.backends.problem import default_device
from fp8route.checkpoint.config_check import check_config
from fp8route.checkpoint.formats import CONFIG, modelopt, read_json
from fp8route.checkpoint.hub import resolve_model_path
from fp8route.checkpoint.load import load_checkpoint
from fp8route.checkpoint.shards import ShardSet, Slices
from fp8route.errors import CheckpointError, Fp8InputError
from fp8route.linear.policy import Policy
from fp8route.models.causal_lm import CausalLM
from fp8route.models.collectives import ONE_SHOT_BYTES, AllReduce, check_method
from fp8route.models.flashinfer_attention import check_attention
from fp8route.models.llama import LlamaConfig
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

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_quantized(folder: Path, config: dict[str, object]) -> bool:
    """Whether the folder says it is a quantized checkpoint (load_checkpoint then checks how)."""
    return "quantization_config" in config or (folder / modelopt.HF_QUANT_CONFIG).is_file()


def read_plain(
    folder: Path, device: torch.device, dtype: torch.dtype | None, slices: Slices | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of an unquantized checkpoint on device, floats in dtype (None: as stored), one
    shard at a time; only the part slices names of a tensor it has an index for. config.json is
    checked against the tensors' header shapes first."""
    shards = ShardSet.open(folder)
    check_config(read_json(folder / CONFIG), shards.tensors)
    tensors: dict[str, torch.Tensor] = {}
    for file, names in shards.by_file().items():
        for name, tensor in shards.read(file, names, slices):
            if tensor.dtype in _FP8:
                raise CheckpointError(
                    f"{name} in {file} is {tensor.dtype} but {folder} has no quantization config "
                    f"(quantization_config in {CONFIG} or {modelopt.HF_QUANT_CONFIG}); its scales cannot be found"
                )
            cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            tensors[name] = tensor.to(device, cast)
    return tensors


def load_model(
    path: str | os.PathLike[str],
    device: str | torch.device | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_batch_size: int = 16,
    max_seq_len: int = 8192,
    policy: Policy | None = None,
    use_cuda_graphs: bool = True,
    all_reduce: str = "nccl",
    tp_lm_head: LmHead = "vocab",
    attention: str = "builtin",
) -> CausalLM:
    """A Llama-family model (Llama, Mistral, Qwen2, Qwen3) from a checkpoint folder, or a Hugging Face
    repository id ("org/name") in the local hub cache (fp8route.checkpoint.hub.resolve_model_path),
    with a KV cache for max_batch_size rows of max_seq_len positions (capped at the config's
    max_position_embeddings). config.json is checked against the tensors' header shapes (layers,
    sizes, heads, vocabulary, tied embeddings) before any weight is read.

    device defaults to CUDA when available. FP8 linears stay FP8 (planned by policy); every
    float tensor (embeddings, norms, unquantized linears, the KV cache) is kept in dtype.

    Under torch.distributed (more than one rank) each rank reads its slices of the checkpoint
    (fp8route.models.parallel); tp_lm_head="vocab" splits lm_head over the vocabulary and gathers
    the logits, "replicated" keeps a whole lm_head on every rank. Every rank returns full logits;
    all_reduce picks how row-parallel outputs are summed (fp8route.models.collectives.METHODS).
    attention="flashinfer" runs FlashInfer's prefill and decode attention over the same cache
    (the flashinfer extra, CUDA); "builtin" is SDPA for prefill and fp8route's decode kernel."""
    if dtype not in FLOAT_DTYPES:
        raise Fp8InputError(f"load_model: dtype must be bfloat16, float16 or float32, got {dtype}")
    check_lm_head(tp_lm_head)
    check_method(all_reduce)
    folder = resolve_model_path(path)
    config = read_json(folder / CONFIG)
    cfg = LlamaConfig.from_hf(config, CONFIG)
    limit = config.get("max_position_embeddings")
    if isinstance(limit, int) and limit > 0:
        max_seq_len = min(max_seq_len, limit)
    target = init_from_env(device) or default_device(device)
    check_attention(attention, target)
    shard = Shard.current()
    slicer = None if shard is None else Slicer.of(cfg, shard, tp_lm_head)
    if is_quantized(folder, config):
        checkpoint = load_checkpoint(folder, target, policy=policy, slices=slicer)
        linears: dict[str, nn.Module] = dict(checkpoint.linears)
        tensors = {n: t.to(dtype) if t.is_floating_point() else t for n, t in checkpoint.tensors.items()}
    else:
        linears, tensors = {}, read_plain(folder, target, dtype, slicer)
    reduce = None
    if slicer is not None:
        reduce = AllReduce(target, dtype, ONE_SHOT_BYTES, all_reduce, width=cfg.hidden_size)
        linears, tensors = wrap_layers(linears, tensors, slicer, reduce)
        cfg = local_config(cfg, slicer.shard.size)
    model = CausalLM(
        cfg,
        linears,
        tensors,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        dtype=dtype,
        device=target,
        use_cuda_graphs=use_cuda_graphs,
        attention=attention,
    )
    if shard is not None and reduce is not None:
        model.parallel = f"tensor parallel rank {shard.rank} of {shard.size}; all-reduce {reduce.describe()}"
    return model
