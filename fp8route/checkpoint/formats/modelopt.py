"""NVIDIA ModelOpt FP8: hf_quant_config.json, or config.json with quant_method "modelopt".

hf_quant_config.json: {"producer": {...}, "quantization": {"quant_algo": ..., "kv_cache_quant_algo":
"FP8" | null, "exclude_modules": ["lm_head", "model.layers.*.mlp*"]}}. config.json's
quantization_config either nests the same "quantization" object or flattens it, naming the
exclusions "ignore" and the KV cache "kv_cache_scheme" (compressed-tensors style). vLLM's ModelOpt
config reads exactly these (quant_algo, kv_cache_quant_algo or kv_cache_scheme, exclude_modules or
ignore, group_size for the FP4 algorithms) and producer.name to recognize a folder as ModelOpt's.

The FP8 quant_algo values, as vLLM reads their tensors:
- FP8: weight_scale and input_scale, one value each (the tensor scheme, static input);
- FP8_PER_CHANNEL_PER_TOKEN: weight_scale [N], no input_scale (the channel scheme);
- FP8_PB_WO: weight_scale [ceil(N/128), 1, ceil(K/128), 1], no input_scale. "Weight-only" by name, but
  vLLM runs it as fp8route's block scheme does, x quantized per 1x128 group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fp8route.checkpoint.formats.scheme import QuantScheme, unsupported
from fp8route.errors import CheckpointError
from fp8route.schemes import Scheme

HF_QUANT_CONFIG = "hf_quant_config.json"
FORMAT = "modelopt"
_TRUE_FLAGS = ("has_zero_point", "pre_quant_scale")  # AWQ-style options; FP8 has neither
# quant_algo -> (scheme, whether each linear has a static input_scale)
ALGOS: dict[str, tuple[Scheme, bool]] = {
    "FP8": ("tensor", True),
    "FP8_PER_CHANNEL_PER_TOKEN": ("channel", False),
    "FP8_PB_WO": ("block", False),
}


def parse_hf_quant_config(data: dict[str, Any], file: str = HF_QUANT_CONFIG) -> QuantScheme:
    quantization = data.get("quantization")
    if not isinstance(quantization, dict):
        raise CheckpointError(f'{file}: expected a "quantization" object, got {quantization!r}')
    return _parse(quantization, "quantization.", file, exclude_key="exclude_modules")


def parse_config_json(qc: dict[str, Any], file: str = "config.json") -> QuantScheme:
    """config.json's quantization_config with quant_method "modelopt"."""
    prefix = "quantization_config."
    if isinstance(qc.get("quantization"), dict):
        return _parse(qc["quantization"], prefix + "quantization.", file, exclude_key="exclude_modules")
    return _parse(qc, prefix, file, exclude_key="ignore" if "ignore" in qc else "exclude_modules")


def _parse(q: dict[str, Any], prefix: str, file: str, exclude_key: str) -> QuantScheme:
    algo = q.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() not in ALGOS:
        # NVFP4, W4A16_NVFP4, MXFP8, W4A16_AWQ, MIXED_PRECISION...
        raise unsupported(prefix + "quant_algo", algo, file)
    scheme, static = ALGOS[algo.upper()]
    for flag in _TRUE_FLAGS:
        if q.get(flag):
            raise unsupported(prefix + flag, q[flag], file)
    kv = _kv_cache(q, prefix, file)
    exclude = q.get(exclude_key, [])
    if exclude is None:
        exclude = []
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise CheckpointError(
            f"{file}: {prefix}{exclude_key} must be a list of module names or wildcards, got {exclude!r}"
        )
    origin = f"{prefix}quant_algo={algo} in {file}"
    return QuantScheme(FORMAT, file, tuple(exclude), kv, scheme, static, origin=origin)


def _kv_cache(q: dict[str, Any], prefix: str, file: str) -> str | None:
    if "kv_cache_scheme" in q and q["kv_cache_scheme"] is not None:
        scheme = q["kv_cache_scheme"]
        if not (isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8):
            raise unsupported(prefix + "kv_cache_scheme", scheme, file)
        return "FP8"
    kv = q.get("kv_cache_quant_algo")
    if kv is None:
        return None
    if not isinstance(kv, str) or kv.upper() != "FP8":
        raise unsupported(prefix + "kv_cache_quant_algo", kv, file)
    return "FP8"


def quant_algo(scheme: Scheme) -> str:
    """The quant_algo fp8route writes for scheme (block is not written: see formats.WRITTEN)."""
    return next(algo for algo, (s, _) in ALGOS.items() if s == scheme)


def config_files(
    exclude: Sequence[str], producer: dict[str, str], kv_cache: bool = False, scheme: Scheme = "tensor"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json's quantization_config, hf_quant_config.json) for a ModelOpt FP8 checkpoint of
    scheme (tensor: FP8, channel: FP8_PER_CHANNEL_PER_TOKEN); kv_cache: with FP8 KV-cache scales
    (`<attn>.k_proj.k_scale` / `<attn>.v_proj.v_scale`).

    Both are written: engines that predate the config.json form read hf_quant_config.json only.
    """
    algo = quant_algo(scheme)
    kv = "FP8" if kv_cache else None
    quantization = {"quant_algo": algo, "kv_cache_quant_algo": kv, "exclude_modules": list(exclude)}
    qc = {
        "quant_method": FORMAT,
        "quant_algo": algo,
        "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"} if kv_cache else None,
        "ignore": list(exclude),
        "producer": producer,
    }
    return qc, {"producer": producer, "quantization": quantization}
