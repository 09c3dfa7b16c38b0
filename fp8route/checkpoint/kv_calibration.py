"""FP8 KV-cache scales from calibration (`fp8route quantize --kv-cache fp8`): the amax of each layer's
cached key (after RoPE, the key the cache holds: vLLM's and llm-compressor's convention) and value
over the calibration tokens, each scale amax / 448, written where the format's readers look.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fp8route.checkpoint import estimators
from fp8route.checkpoint.formats import compressed_tensors
from fp8route.kernels.fused import rope

KV_CACHE = ("fp8",)


class KvObserver:
    """An AttentionContext for calibration's cache-less forward: causal attention as the model's own,
    keeping the running amax of the rotated K and of V."""

    def __init__(self) -> None:
        self.k_amax = 0.0
        self.v_amax = 0.0

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        q, k, v = rope(q, cos, sin), rope(k, cos, sin), v.transpose(1, 2)
        self.k_amax = max(self.k_amax, float(k.abs().max()))
        self.v_amax = max(self.v_amax, float(v.abs().max()))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def scales(self, attn: str, format: str) -> dict[str, float]:
        """Tensor name -> scale for the attention module `attn` (`model.layers.<i>.self_attn`):
        compressed-tensors names them on the attention, ModelOpt on k_proj / v_proj."""
        k, v = estimators.max_scale(self.k_amax), estimators.max_scale(self.v_amax)
        if format == compressed_tensors.FORMAT:
            return {f"{attn}.k_scale": k, f"{attn}.v_scale": v}
        return {f"{attn}.k_proj.k_scale": k, f"{attn}.v_proj.v_scale": v}
