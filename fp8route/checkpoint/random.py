"""Checkpoints of a real model's dimensions with random weights, written the way real ones are, so a
benchmark runs the real loading path on a machine that cannot download the weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fp8route.checkpoint.dynamic_weights import dynamic_linear
from fp8route.checkpoint.formats import CONFIG, DEFAULT_FORMAT, compressed_tensors, fp8, modelopt
from fp8route.checkpoint.shards import ShardWriter
from fp8route.errors import Fp8InputError
from fp8route.models.shapes import ProjectionDims
from fp8route.quant import FP8_MAX, quantize_per_tensor
from fp8route.schemes import Scheme, check_scheme
from fp8route.version import __version__

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random(
    folder: Path,
    config: dict[str, object],
    *,
    fp8: bool,
    device: str = "cuda",
    seed: int = 0,
    scheme: Scheme = "tensor",
) -> Path:
    """config.json and shards of random weights (std 0.02, norms at 1), or all bf16 (fp8=False);
    lm_head in bf16. With fp8, every projection in scheme, in the format `fp8route quantize --scheme`
    writes it by default: tensor, ModelOpt FP8 (static input scale amax 8 / 448); channel,
    compressed-tensors FP8_DYNAMIC; block, quant_method fp8 (DeepSeek-V3/Qwen3)."""
    check_scheme(scheme)
    if not fp8 and scheme != "tensor":
        raise Fp8InputError(f"write_random: scheme={scheme!r} needs fp8=True (a bf16 checkpoint has no scheme)")
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    size = ProjectionDims.from_hf(config)
    h, inter, heads, kv, hd = size.hidden, size.intermediate, size.heads, size.kv_heads, size.head_dim
    vocab, layers = int(str(config["vocab_size"])), int(str(config["num_hidden_layers"]))
    shapes = {
        "q_proj": (heads * hd, h),
        "k_proj": (kv * hd, h),
        "v_proj": (kv * hd, h),
        "o_proj": (h, heads * hd),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }
    writer = ShardWriter(folder)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02

    writer.add("model.embed_tokens.weight", randn(vocab, h))
    for i in range(layers):
        p = f"model.layers.{i}"
        for name in ("input_layernorm", "post_attention_layernorm"):
            writer.add(f"{p}.{name}.weight", torch.ones(h, dtype=torch.bfloat16))
        for name in _LINEARS:
            module = f"{p}.{'self_attn' if name.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{name}"
            weight = randn(*shapes[name])
            if not fp8:
                writer.add(f"{module}.weight", weight)
            elif scheme == "tensor":
                q, scale = quantize_per_tensor(weight.float())
                writer.add(f"{module}.weight", q)
                writer.add(f"{module}.weight_scale", scale.float().reshape(()))
                writer.add(f"{module}.input_scale", torch.tensor(8.0 / FP8_MAX))
            else:
                for tensor_name, tensor in dynamic_linear(module, weight, scheme, DEFAULT_FORMAT[scheme]).items():
                    writer.add(tensor_name, tensor)
    writer.add("model.norm.weight", torch.ones(h, dtype=torch.bfloat16))
    writer.add("lm_head.weight", randn(vocab, h))
    writer.close()
    out = dict(config)
    if fp8:
        out["quantization_config"] = _quantization_config(folder, scheme)
    (folder / CONFIG).write_text(json.dumps(out, indent=2) + "\n")
    return folder


def _quantization_config(folder: Path, scheme: Scheme) -> dict[str, object]:
    """config.json's quantization_config for scheme's default format (ModelOpt's hf_quant_config.json
    written beside it)."""
    if scheme == "channel":
        return compressed_tensors.quantization_config(["lm_head"], scheme="channel")
    if scheme == "block":
        return fp8.quantization_config(["lm_head"])
    qc, hf_quant = modelopt.config_files(["lm_head"], {"name": "fp8route (random weights)", "version": __version__})
    (folder / modelopt.HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=2) + "\n")
    return qc
