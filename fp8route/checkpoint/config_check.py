"""config.json against the tensors it describes, from the shard headers alone, before any data is read.

A config that disagrees with its checkpoint either loads and answers wrong (num_hidden_layers one
short drops a layer) or fails deep inside the first forward (a head count that splits q/k/v at the
wrong widths). Both are caught here, in milliseconds: every size the config gives (layers, hidden,
intermediate, heads, KV heads, head_dim, vocabulary, tied embeddings) is compared with the shapes
of the tensors that carry it, and the first disagreement is one line naming the tensor, its shape
and the config value.

Only the Llama-family layout is known here (Hugging Face names, `model.layers.N.`): its
architectures are the ones the built-in runner runs. Other architectures are not checked (the
returned None says so; `fp8route inspect` prints it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fp8route.checkpoint.shards import TensorInfo
from fp8route.errors import CheckpointError
from fp8route.models.llama import ARCHITECTURES

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EMBED, _NORM, _LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
_REQUIRED = (
    ("input_layernorm.weight",),
    ("post_attention_layernorm.weight",),
    ("self_attn.q_proj.weight", "self_attn.qkv_proj.weight"),
    ("self_attn.k_proj.weight", "self_attn.qkv_proj.weight"),
    ("self_attn.v_proj.weight", "self_attn.qkv_proj.weight"),
    ("self_attn.o_proj.weight",),
    ("mlp.gate_proj.weight", "mlp.gate_up_proj.weight"),
    ("mlp.up_proj.weight", "mlp.gate_up_proj.weight"),
    ("mlp.down_proj.weight",),
)


@dataclass(frozen=True)
class Size:
    """One dimension a config gives a tensor: its value, how the config spells it, which keys set it."""

    value: int
    terms: str  # e.g. "num_key_value_heads=2 * head_dim 16 (hidden_size / num_attention_heads)"
    keys: str  # the config.json keys to correct, e.g. "num_key_value_heads, num_attention_heads or head_dim"
    head_dim: int = 0  # for a size counted in heads: what a mismatching size holds is said in heads too
    heads: str = ""  # "heads" or "KV heads"


@dataclass(frozen=True)
class ModelDims:
    """What a Llama-family config.json says its tensors hold."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_given: bool  # False: hidden_size / num_attention_heads
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, config: Mapping[str, Any], file: str = "config.json") -> ModelDims | None:
        """The sizes of a config of a checked architecture (None for any other); CheckpointError
        for a missing or malformed size."""
        archs = config.get("architectures") or []
        if archs and not any(a in ARCHITECTURES for a in archs):
            return None
        keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
        missing = [k for k in keys if k not in config]
        if missing:
            raise CheckpointError(f"{file}: missing {', '.join(missing)}")
        hidden, intermediate, heads, layers, vocab = (_positive(config, k, file) for k in keys)
        kv_heads = _positive(config, "num_key_value_heads", file) if config.get("num_key_value_heads") else heads
        head_dim = _positive(config, "head_dim", file) if config.get("head_dim") else 0
        tied = config.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise CheckpointError(f"{file}: tie_word_embeddings must be true or false, got {tied!r}")
        return cls(
            layers, hidden, intermediate, heads, kv_heads, head_dim or hidden // heads, bool(head_dim), vocab, tied
        )

    def describe(self) -> str:
        return (
            f"{self.layers} layers, hidden {self.hidden}, intermediate {self.intermediate}, {self.heads} heads and "
            f"{self.kv_heads} KV heads of {self.head_dim}, vocabulary {self.vocab}"
            + (", embeddings tied" if self.tied else "")
        )

    def shapes(self) -> dict[str, tuple[Size, ...]]:
        """Checkpoint name suffix (inside a layer) or full name -> the size of each dimension."""
        hd = (
            f"head_dim={self.head_dim}"
            if self.head_dim_given
            else f"head_dim {self.head_dim} (hidden_size / num_attention_heads)"
        )
        either = " or head_dim" if self.head_dim_given else " (or give head_dim)"
        hidden = Size(self.hidden, f"hidden_size={self.hidden}", "hidden_size")
        inter = Size(self.intermediate, f"intermediate_size={self.intermediate}", "intermediate_size")
        vocab = Size(self.vocab, f"vocab_size={self.vocab} (one row per token id)", "vocab_size")
        q = Size(
            self.heads * self.head_dim,
            f"num_attention_heads={self.heads} * {hd}",
            "num_attention_heads" + either,
            self.head_dim,
            "heads",
        )
        kv = Size(
            self.kv_heads * self.head_dim,
            f"num_key_value_heads={self.kv_heads} * {hd}",
            "num_key_value_heads" + (either if self.head_dim_given else " or num_attention_heads (or give head_dim)"),
            self.head_dim,
            "KV heads",
        )
        qkv = Size(
            (self.heads + 2 * self.kv_heads) * self.head_dim,
            f"(num_attention_heads={self.heads} + 2 * num_key_value_heads={self.kv_heads}) * {hd}",
            "num_attention_heads, num_key_value_heads or head_dim"
            if self.head_dim_given
            else "num_attention_heads or num_key_value_heads (or give head_dim)",
            self.head_dim,
            "heads",
        )
        gate_up = Size(2 * self.intermediate, f"2 * intermediate_size={self.intermediate}", "intermediate_size")
        head = Size(self.head_dim, hd, "head_dim" if self.head_dim_given else "num_attention_heads or head_dim")
        out: dict[str, tuple[Size, ...]] = {
            _EMBED: (vocab, hidden),
            _NORM: (hidden,),
            _LM_HEAD: (vocab, hidden),
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "self_attn.q_norm.weight": (head,),
            "self_attn.k_norm.weight": (head,),
        }
        for name, rows, cols in (
            ("self_attn.q_proj", q, hidden),
            ("self_attn.k_proj", kv, hidden),
            ("self_attn.v_proj", kv, hidden),
            ("self_attn.qkv_proj", qkv, hidden),
            ("self_attn.o_proj", hidden, q),
            ("mlp.gate_proj", inter, hidden),
            ("mlp.up_proj", inter, hidden),
            ("mlp.gate_up_proj", gate_up, hidden),
            ("mlp.down_proj", hidden, inter),
        ):
            out[f"{name}.weight"], out[f"{name}.bias"] = (rows, cols), (rows,)
        return out


def check_config(
    config: Mapping[str, Any], tensors: Mapping[str, TensorInfo], file: str = "config.json"
) -> ModelDims | None:
    """Raise CheckpointError at the first tensor whose header shape config.json contradicts: layers
    the config does not have (or lacks), hidden and intermediate sizes, head and KV-head counts (the
    q/k/v/o shapes, separate or fused), vocabulary (embedding and lm_head rows), a missing lm_head
    without tied embeddings. tensors: ShardSet.tensors, whole shapes (check before any slicing).
    Returns the sizes checked, or None when the architecture is not one fp8route knows."""
    dims = ModelDims.from_config(config, file)
    if dims is None:
        return None
    shapes = dims.shapes()
    for name in (_EMBED, _NORM):
        if name not in tensors:
            raise CheckpointError(f"{name} is in no shard, but the Llama-family model {file} describes needs it")
    _check_shape(tensors[_EMBED], shapes[_EMBED], file)
    if _LM_HEAD in tensors:
        _check_shape(tensors[_LM_HEAD], shapes[_LM_HEAD], file)
    elif not dims.tied:
        told = "tie_word_embeddings=false" if "tie_word_embeddings" in config else "no tie_word_embeddings (false)"
        raise CheckpointError(
            f"{_LM_HEAD} is in no shard and {file} has {told}: set tie_word_embeddings to true if the output "
            f"layer shares {_EMBED} (shape {list(tensors[_EMBED].shape)}), or add {_LM_HEAD}"
        )
    _check_shape(tensors[_NORM], shapes[_NORM], file)
    if not dims.head_dim_given and dims.hidden % dims.heads:
        raise CheckpointError(
            f"{file}: hidden_size={dims.hidden} is not a multiple of num_attention_heads={dims.heads} and there is "
            "no head_dim: correct num_attention_heads (or give head_dim) to match the checkpoint"
        )
    layers: dict[int, list[TensorInfo]] = {}
    for info in tensors.values():
        match = _LAYER.match(info.name)
        if match:
            layers.setdefault(int(match.group(1)), []).append(info)
    _check_layer_count(dims.layers, layers, file)
    for index in range(dims.layers):
        prefix = f"model.layers.{index}."
        present = {info.name.removeprefix(prefix): info for info in layers[index]}
        for options in _REQUIRED:
            if not any(o in present for o in options):
                raise CheckpointError(
                    f"{prefix}{options[0]} is in no shard, but {file} has num_hidden_layers={dims.layers}, "
                    f"which includes layer {index}"
                    + (f" (nor is {prefix}{options[1]}, which would hold it)" if len(options) > 1 else "")
                    + ": the checkpoint is incomplete (a shard missing?) or num_hidden_layers is wrong"
                )
        for suffix, sizes in shapes.items():
            if suffix in present:
                _check_shape(present[suffix], sizes, file)
    return dims


def _check_layer_count(count: int, layers: dict[int, list[TensorInfo]], file: str) -> None:
    held = sorted(layers)
    contiguous = held == list(range(len(held)))
    holds = (
        "none"
        if not held
        else f"layers 0-{held[-1]}"
        if contiguous
        else f"{len(held)} layers numbered {held[0]} to {held[-1]}"
    )
    fix = f"set num_hidden_layers to {len(held)}" if contiguous and held else "correct num_hidden_layers"
    extra = [i for i in held if i >= count]
    if extra:
        first = sorted(layers[extra[0]], key=lambda info: info.name)[0]
        others = sum(len(layers[i]) for i in extra) - 1
        more = f", and {others} more tensors" if others > 1 else ", and 1 more tensor" if others else ""
        which = f"layer {extra[0]}" if len(extra) == 1 else f"layers {', '.join(map(str, extra))}"
        raise CheckpointError(
            f"{file} has num_hidden_layers={count}, but the checkpoint holds {which} too ({first.where}, shape "
            f"{list(first.shape)}{more}; it holds {holds}): {fix} in {file}"
        )
    missing = [i for i in range(count) if i not in layers]
    if missing:
        which = f"layer {missing[0]}" if len(missing) == 1 else f"layers {missing[0]}-{missing[-1]}"
        raise CheckpointError(
            f"{file} has num_hidden_layers={count}, but no tensor of {which} (model.layers.{missing[0]}.*) is in "
            f"the checkpoint, which holds {holds}: {fix} in {file}"
        )


def _check_shape(info: TensorInfo, sizes: tuple[Size, ...], file: str) -> None:
    if len(info.shape) != len(sizes):
        raise CheckpointError(
            f"{info.where} has shape {list(info.shape)}, but {file}'s model has a {len(sizes)}-D tensor there "
            f"({' x '.join(s.terms for s in sizes)})"
        )
    what = ("elements",) if len(sizes) == 1 else ("rows", "columns")
    for got, size, label in zip(info.shape, sizes, what, strict=True):
        if got != size.value:
            held = ""
            if size.heads and got % size.head_dim == 0:
                held = f" (its {got} are {got // size.head_dim} {size.heads} of {size.head_dim})"
            raise CheckpointError(
                f"{info.where} has shape {list(info.shape)}, but {file}'s {size.terms} gives it {size.value} "
                f"{label}{held}: correct {size.keys} in {file} to match the checkpoint"
            )


def _positive(config: Mapping[str, Any], key: str, file: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{file}: {key} must be a positive integer, got {value!r}")
    return value
