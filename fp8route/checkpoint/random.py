"""Checkpoints of a real model's dimensions with random weights, written the way real ones are, so a
benchmark runs the real loading path on a machine that cannot download the weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fp8route.checkpoint.formats import CONFIG, modelopt
from fp8route.checkpoint.shards import ShardWriter
from fp8route.models.shapes import ProjectionDims
from fp8route.quant import FP8_MAX, quantize_per_tensor
from fp8route.version import __version__

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random(folder: Path, config: dict[str, object], *, fp8: bool, device: str = "cuda", seed: int = 0) -> Path:
    """config.json and shards of random weights (std 0.02, norms at 1): every projection FP8 per tensor
    with ModelOpt's files (static input scale amax 8 / 448), or all bf16 (fp8=False); lm_head in bf16."""
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
            if fp8:
                q, scale = quantize_per_tensor(weight.float())
                writer.add(f"{module}.weight", q)
                writer.add(f"{module}.weight_scale", scale.float().reshape(()))
                writer.add(f"{module}.input_scale", torch.tensor(8.0 / FP8_MAX))
            else:
                writer.add(f"{module}.weight", weight)
    writer.add("model.norm.weight", torch.ones(h, dtype=torch.bfloat16))
    writer.add("lm_head.weight", randn(vocab, h))
    writer.close()
    out = dict(config)
    if fp8:
        qc, hf_quant = modelopt.config_files(["lm_head"], {"name": "fp8route (random weights)", "version": __version__})
        out["quantization_config"] = qc
        (folder / modelopt.HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=2) + "\n")
    (folder / CONFIG).write_text(json.dumps(out, indent=2) + "\n")
    return folder
