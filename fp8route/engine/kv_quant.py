"""The KV cache's element type (vLLM's `kv_cache_dtype`): "auto" keeps K and V in the model's
dtype; "fp8" stores them as float8_e4m3fn, one scale per layer for K and one for V.

The convention is vLLM's: the cache holds fp8(x / scale) and a read gives fp8 * scale, and the
key's scale is for the key as it is cached, after RoPE (llm-compressor observes the key states
the attention caches; vLLM's calculate_kv_scales takes the rotated key). Scales come from the
checkpoint (ModelOpt `kv_cache_quant_algo: FP8`, compressed-tensors `kv_cache_scheme`: tensors
`<attn>.k_scale` / `<attn>.v_scale`, or on k_proj / v_proj, fp8route.checkpoint.layout), which
`fp8route quantize --kv-cache fp8` writes from calibration; without them every scale is 1.0 and
one warning says so (values past +-448 then saturate).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fp8route.errors import CheckpointError
from fp8route.kernels.fused import rope
from fp8route.quant import FP8_MAX, quantize_by_inverse

log = logging.getLogger("fp8route")

FP8_KV = torch.float8_e4m3fn
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class KVScales:
    """One K and one V scale per layer (fp32 values, host floats: fixed for the model's life, so a
    captured decode graph may bake them in) and where they came from, for messages."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    source: str

    @classmethod
    def ones(cls, layers: int, source: str = "1.0 (no scales)") -> KVScales:
        return cls((1.0,) * layers, (1.0,) * layers, source)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], layers: int, source: str) -> KVScales:
        """From a checkpoint's `model.layers.<i>.self_attn.{k,v}_scale` (Checkpoint.kv_scales): every
        layer must have both, or none (then it is not an FP8-KV checkpoint)."""
        found: dict[tuple[str, int], float] = {}
        for name, tensor in tensors.items():
            match = _LAYER.search(name)
            kind = name.rpartition(".")[2]
            if match is None or kind not in ("k_scale", "v_scale"):
                raise CheckpointError(f"{source}: KV-cache scale {name} belongs to no decoder layer")
            value = float(tensor.float().reshape(-1)[0])
            if not value > 0 or value == float("inf"):
                raise CheckpointError(f"{source}: {name} is {value}; a KV-cache scale must be positive and finite")
            found[kind, int(match.group(1))] = value
        missing = [
            f"layer {i} {kind}" for i in range(layers) for kind in ("k_scale", "v_scale") if (kind, i) not in found
        ]
        if missing:
            raise CheckpointError(
                f"{source}: KV-cache scales for {len(found)} of {2 * layers} tensors; missing {', '.join(missing[:4])}"
            )
        k = tuple(found["k_scale", i] for i in range(layers))
        return cls(k, tuple(found["v_scale", i] for i in range(layers)), source)


def kv_scales_for(
    kv_cache_dtype: str, tensors: Mapping[str, torch.Tensor], layers: int, source: str, scheme: str | None = None
) -> KVScales | None:
    """The pool's scales: None for "auto" (the model's dtype, no scales); for "fp8" the checkpoint's
    (tensors: Checkpoint.kv_scales; scheme: its config's KV-cache scheme, QuantScheme.kv_cache),
    else 1.0 with one warning naming why. kv_cache_dtype is one EngineConfig has checked."""
    if kv_cache_dtype == "auto":
        return None
    if tensors:
        return KVScales.from_tensors(tensors, layers, source)
    why = (
        f"its config says {scheme} but it has no k_scale/v_scale tensors"
        if scheme
        else "it has no KV-cache scales (kv_cache_quant_algo / kv_cache_scheme)"
    )
    log.warning(
        "kv_cache_dtype='fp8' with every K/V scale 1.0: %s: %s (values past +-%g saturate; "
        "`fp8route quantize --kv-cache fp8` calibrates them)",
        source,
        why,
        FP8_MAX,
    )
    return KVScales.ones(layers)


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in e4m3, saturated at +-448 (a CUDA cast would make NaN of what lies past it)."""
    return quantize_by_inverse(x, scale)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


class RoundTripAttention:
    """An AttentionContext for the full (cache-less) forward in which every query reads K and V as an
    fp8 cache would give them back: rotated K and V rounded through e4m3 with the layer's scales,
    then causal SDPA. It is how `fp8route eval --kv-cache-dtype fp8` scores a prompt: as the engine
    reads an fp8 cache, every position through the cache, a fresh chunk's own too."""

    def __init__(self, scales: KVScales) -> None:
        self.scales = scales

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        k_scale, v_scale = self.scales.k[layer], self.scales.v[layer]
        k = dequantize_kv(quantize_kv(rope(k, cos, sin), k_scale), k_scale, k.dtype)
        v = dequantize_kv(quantize_kv(v.transpose(1, 2), v_scale), v_scale, v.dtype)
        return torch.nn.functional.scaled_dot_product_attention(
            rope(q, cos, sin), k, v, is_causal=True, enable_gqa=True
        )
