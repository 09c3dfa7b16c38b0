"""What `fp8route quantize` and the random checkpoints write for one linear of a dynamic scheme (its
input quantized at run time, so no input_scale): the e4m3 weight and its weight scale, named, shaped
and typed as each format's own tools write them.

- channel, ModelOpt FP8_PER_CHANNEL_PER_TOKEN: `weight_scale` [N] fp32;
- channel, compressed-tensors FP8_DYNAMIC: `weight_scale` [N, 1] in the weight's dtype;
- block, quant_method fp8 (DeepSeek-V3, Qwen3): `weight_scale_inv` [ceil(N/128), ceil(K/128)] fp32;
- block, compressed-tensors FP8_BLOCK: `weight_scale` [ceil(N/128), ceil(K/128)] in the weight's dtype.

llm-compressor keeps its scales in the model's dtype (compressed-tensors' initialize_qparams); the
e4m3 values are made with the scale as stored, rounded, so what loads is what the weight was divided by.
"""

from __future__ import annotations

import torch

from fp8route.checkpoint.formats import compressed_tensors, fp8
from fp8route.quant import quantize
from fp8route.schemes import Scheme, expand_blocks, quantize_weight


def dynamic_linear(module: str, weight: torch.Tensor, scheme: Scheme, format: str) -> dict[str, torch.Tensor]:
    """The tensors of the FP8 linear `module` quantized from weight [N, K] (finite, float) in scheme
    ("channel" or "block"), as format stores them: {name: tensor}."""
    scale_dtype = weight.dtype if format == compressed_tensors.FORMAT else torch.float32
    w32 = weight.float()
    scale = quantize_weight(w32, scheme)[1].to(scale_dtype)
    per_element = scale.float()[:, None] if scheme == "channel" else expand_blocks(scale.float(), *w32.shape)
    name = fp8.SCALE_INV if format == fp8.FORMAT else "weight_scale"
    if scheme == "channel" and format == compressed_tensors.FORMAT:
        scale = scale[:, None]
    return {f"{module}.weight": quantize(w32, per_element), f"{module}.{name}": scale}
