"""save_pretrained: a transformers model with Fp8Linear layers -> a ModelOpt FP8 checkpoint folder.

The folder is what fp8route.quantize_checkpoint writes: e4m3 weights with scalar fp32
weight_scale and input_scale per quantized linear, every other tensor as the model holds it,
config.json with ModelOpt's quantization_config and hf_quant_config.json. fp8route's loaders,
fp8route.hf.from_pretrained and ModelOpt-reading engines all take it. Tokenizer files are not
written: save the tokenizer into the same folder yourself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch import nn
from transformers import PreTrainedModel

from fp8route.checkpoint.destination import check_room, write_into
from fp8route.checkpoint.formats import modelopt
from fp8route.checkpoint.shards import ShardWriter, check_shard_bytes
from fp8route.errors import Fp8InputError
from fp8route.hf.config import Fp8RouteConfig
from fp8route.linear.layer import Fp8Linear


def save_pretrained(model: PreTrainedModel, path: str | os.PathLike[str], *, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write model (its Fp8Linear layers static per tensor) as a ModelOpt FP8 checkpoint; returns the folder."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise Fp8InputError(f"save_pretrained: {folder} is a file; choose a folder")
    fp8 = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    if not fp8:
        raise Fp8InputError(
            "save_pretrained: the model has no Fp8Linear layers; quantize it first (fp8route.hf.quantize_model)"
        )
    check_shard_bytes(max_shard_bytes)
    dynamic = [name for name, m in fp8.items() if m.input_scale is None]
    if dynamic:
        raise Fp8InputError(
            f"save_pretrained: {', '.join(dynamic[:4])} compute their input scale per call; a static FP8 "
            "checkpoint needs one input_scale per linear (quantize_model calibrates them)"
        )
    check_room(folder, _state_bytes(model), f"save_pretrained: {folder}")
    write_into(folder, lambda tmp: _write(model, fp8, tmp, max_shard_bytes))
    return folder


def _write(model: PreTrainedModel, fp8: dict[str, Fp8Linear], out: Path, max_shard_bytes: int) -> None:
    writer = ShardWriter(out, max_shard_bytes)
    seen: set[tuple[object, ...]] = set()
    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module in fp8:
            if leaf in ("weight_scale", "input_scale"):
                tensor = tensor.float().reshape(()).clone()  # ModelOpt writes scalar scales as shape []
            writer.add(name, tensor)
            continue
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue  # a tied weight (lm_head = embed_tokens): stored once, as transformers does
        seen.add(key)
        writer.add(name, tensor)
    writer.close()
    kept = sorted(name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in fp8)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    config = Fp8RouteConfig(exclude=[*kept, *(["lm_head"] if tied and "lm_head" not in kept else [])])
    model.config.quantization_config = config  # config.json's quantization_config: ModelOpt's form
    model.config.save_pretrained(out)
    (out / modelopt.HF_QUANT_CONFIG).write_text(json.dumps(config.hf_quant_config(), indent=2) + "\n")
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(out)


def _state_bytes(model: nn.Module) -> int:
    """What the shards will take, about: each distinct tensor once."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values() if t.numel()}
    return sum(t.numel() * t.element_size() for t in tensors.values())
