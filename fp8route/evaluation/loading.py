"""Load a checkpoint folder for evaluation: the built-in Llama runner and the folder's tokenizer.

Either kind of folder works: a per-tensor FP8 one (ModelOpt or compressed-tensors, through
load_checkpoint, so its linears are Fp8Linears) or a plain bf16/fp16 Hugging Face one, so the
two can be scored side by side on the same token ids.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fp8route.errors import CheckpointError, Fp8InputError
from fp8route.formats import CONFIG, modelopt, read_json

TOKENIZER = "tokenizer.json"


def is_fp8_folder(folder: Path, config: dict[str, Any]) -> bool:
    """Whether the folder declares a quantization scheme (config.json or hf_quant_config.json)."""
    return "quantization_config" in config or (folder / modelopt.HF_QUANT_CONFIG).is_file()


def load_tokenizer(folder: str | os.PathLike[str]) -> Any:
    """The folder's tokenizer.json as a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer

    path = Path(folder) / TOKENIZER
    if not path.is_file():
        raise Fp8InputError(
            f"{path.parent}: no {TOKENIZER}; evaluation needs the model's tokenizer "
            "(folders made by gguf_to_hf or copied from the Hugging Face Hub have one)"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type on malformed files
        raise Fp8InputError(f"{path}: not a tokenizers file: {e}") from None


def load_for_eval(
    path: str | os.PathLike[str], device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Any]:
    """(model, tokenizer) for a checkpoint folder: `model(input_ids[B, T]) -> logits[B, T, V]`,
    computed in dtype (None: the embedding's, bf16 for these folders). FP8 layers quantize their
    inputs to FP8 whatever dtype the activations are carried in."""
    from fp8route.checkpoint import load_checkpoint
    from fp8route.models.llama import LlamaConfig, LlamaForCausalLM
    from fp8route.shards import ShardSet

    folder = Path(path)
    if not folder.is_dir():
        raise Fp8InputError(f"{folder}: no such checkpoint folder")
    config = read_json(folder / CONFIG)
    tokenizer = load_tokenizer(folder)
    device = torch.device(device)
    if is_fp8_folder(folder, config):
        model = LlamaForCausalLM.from_checkpoint(load_checkpoint(folder, device))
    else:
        shards = ShardSet.open(folder)
        tensors = {name: t.to(device) for file in shards.files for name, t in shards.read(file)}
        if not tensors:
            raise CheckpointError(f"{folder}: no tensors in its safetensors files")
        model = LlamaForCausalLM(LlamaConfig.from_hf(config), {}, tensors)
    model.eval()
    return (model if dtype is None else functools.partial(model, dtype=dtype)), tokenizer
