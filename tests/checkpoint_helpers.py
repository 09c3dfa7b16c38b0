"""Small Hugging Face-style checkpoints written by the tests themselves."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers.pre_tokenizers import ByteLevel

from fp8route.quant import quantize_per_tensor
from fp8route.schemes import quantize_weight

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
# Different spreads per projection, so fused shards really carry different scales.
_STD = {
    "q_proj": 0.08,
    "k_proj": 0.15,
    "v_proj": 0.04,
    "o_proj": 0.08,
    "gate_proj": 0.1,
    "up_proj": 0.05,
    "down_proj": 0.06,
}


def llama_tensors(
    config: dict[str, Any] = TINY, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * hd
    shapes = {
        "q_proj": (h, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, h),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(v, h, generator=g)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"{p}.{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        for name, shape in shapes.items():
            group = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            t[f"{p}.{group}.{name}.weight"] = _STD[name] * torch.randn(*shape, generator=g)
    t["model.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    if not config.get("tie_word_embeddings"):
        t["lm_head.weight"] = 0.05 * torch.randn(v, h, generator=g)
    return {k: x.to(dtype) for k, x in t.items()}


def write_checkpoint(
    folder: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], shards: int = 1, **extra_files: Any
) -> Path:
    """config.json, the tensors split over `shards` files (with an index when more than one),
    and any extra JSON files given as name=content (file names with dots: pass a dict via **{})."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(folder / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = names[s::shards]
            save_file({n: tensors[n].contiguous() for n in part}, str(folder / file))
            weight_map.update(dict.fromkeys(part, file))
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name, content in extra_files.items():
        (folder / name).write_text(json.dumps(content))
    return folder


def fp8_linear_tensors(
    prefix: str, n: int = 32, k: int = 64, seed: int = 0, scale_shape: tuple[int, ...] = ()
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    qweight, scale = quantize_per_tensor(torch.randn(n, k, generator=g) * 0.1)
    return {
        f"{prefix}.weight": qweight,
        f"{prefix}.weight_scale": scale.reshape(scale_shape),
        f"{prefix}.input_scale": torch.tensor(0.02).reshape(scale_shape),
    }


MODELOPT_HF_QUANT = {
    "producer": {"name": "modelopt", "version": "0.19.0"},
    "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]},
}


def ct_config(ignore: list[str] | None = None) -> dict[str, Any]:
    args = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(args), "input_activations": dict(args)}},
        "ignore": ["lm_head"] if ignore is None else ignore,
    }


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_INPUT_AMAX = {
    "q_proj": 3.0,
    "k_proj": 3.0,
    "v_proj": 3.0,
    "o_proj": 1.5,
    "gate_proj": 4.0,
    "up_proj": 4.0,
    "down_proj": 6.0,
}


def fp8_llama(scale_shape=(), scale_dtype=torch.float32, bias=False, config=TINY):
    """The tiny Llama with every projection quantized per tensor, lm_head left in bf16."""
    out = {}
    for name, t in llama_tensors(config).items():
        module = name.removesuffix(".weight")
        if module.rpartition(".")[2] in LINEARS:
            q, s = quantize_per_tensor(t.float())
            out[name] = q
            out[f"{module}.weight_scale"] = s.reshape(scale_shape).to(scale_dtype)
            out[f"{module}.input_scale"] = (
                torch.tensor(_INPUT_AMAX[module.rpartition(".")[2]] / 448).reshape(scale_shape).to(scale_dtype)
            )
            if bias and module.rpartition(".")[2] in ("q_proj", "k_proj", "v_proj"):
                out[f"{module}.bias"] = 0.1 * torch.randn(t.shape[0]).to(torch.bfloat16)
        else:
            out[name] = t
    return out


# The tiny Llama's dimensions where q/k/v fuse in 128-row blocks (q 256, k and v 128 rows) but gate/up
# do not (320 rows: 2.5 blocks), and down_proj's K (320) ends in a partial block.
BLOCKY = {**TINY, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 320}
QWEN3_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def scheme_llama(
    scheme: str,
    config: dict[str, Any] = TINY,
    scale_name: str = "weight_scale",
    scale_dtype: torch.dtype = torch.float32,
    scale_shape=None,
) -> dict[str, torch.Tensor]:
    """The tiny Llama with every projection quantized in scheme (amax/448 per tensor, row or 128x128
    block), its scale named scale_name in scale_dtype and reshaped by scale_shape (default: as the
    layer holds it, except channel scales [N, 1] as compressed-tensors writes them); no input scales;
    lm_head left in bf16."""
    out = {}
    for name, t in llama_tensors(config).items():
        module = name.removesuffix(".weight")
        if module.rpartition(".")[2] not in LINEARS:
            out[name] = t
            continue
        q, scale = quantize_weight(t.float(), scheme)
        if scale_shape is not None:
            scale = scale_shape(scale)
        elif scheme == "channel":
            scale = scale[:, None]
        out[name] = q
        out[f"{module}.{scale_name}"] = scale.to(scale_dtype)
    return out


def modelopt_folder(tmp_path, tensors=None, shards=1, config=None):
    return write_checkpoint(
        tmp_path / "ckpt",
        fp8_llama() if tensors is None else tensors,
        TINY if config is None else config,
        shards=shards,
        **{"hf_quant_config.json": MODELOPT_HF_QUANT},
    )


def ct_folder(tmp_path, tensors, ignore=None):
    return write_checkpoint(tmp_path / "ckpt", tensors, {**TINY, "quantization_config": ct_config(ignore)})


SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' "
    "+ '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def synthetic_gguf_metadata(pre: str = "smollm") -> dict:
    """Two control tokens, the 256 byte symbols, and merges that make ' the' and 'he' whole."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = specials + alphabet + ["Ġt", "he", "Ġthe"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(specials) + [1] * (len(tokens) - len(specials)),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": SMOLLM2_TEMPLATE,
    }


TEXT_VOCAB = 262  # synthetic_gguf_metadata's tokens: 3 specials, 256 bytes, 3 merges


def text_model_folder(folder: Path, fp8: bool = True, seed: int = 0, max_positions: int = 256) -> Path:
    """A tiny Llama checkpoint with a real byte-level BPE tokenizer and a chat template (EOS id 2):
    what the text-in, text-out entry points (LLM, the server) need, on a CPU in seconds."""
    from fp8route.checkpoint.gguf_tokenizer import write_tokenizer

    config = {**TINY, "vocab_size": TEXT_VOCAB, "eos_token_id": 2, "max_position_embeddings": max_positions}
    tensors = llama_tensors(config, seed=seed)
    if fp8:
        write_checkpoint(folder, fp8_llama(config=config), config, **{"hf_quant_config.json": MODELOPT_HF_QUANT})
    else:
        write_checkpoint(folder, tensors, config)
    write_tokenizer(synthetic_gguf_metadata(), folder)
    return folder


def hub_snapshot(cache: Path, repo_id: str, folder: Path, commit: str = "0123456789abcdef" * 2 + "01234567") -> Path:
    """Move a checkpoint folder into a Hugging Face hub cache as huggingface_hub lays one out:
    each file's content in models--ORG--NAME/blobs/<sha256>, the snapshot's files relative links to
    them, refs/main naming the commit. Returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
