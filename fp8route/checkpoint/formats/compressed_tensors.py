"""compressed-tensors (llm-compressor) FP8: config.json's quantization_config with
quant_method "compressed-tensors", format float-quantized or naive-quantized, and config_groups
whose weights and input_activations are {num_bits: 8, type: float, strategy: tensor, dynamic: false}.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fp8route.checkpoint.formats.scheme import QuantScheme, unsupported
from fp8route.errors import CheckpointError

FORMAT = "compressed-tensors"
# Both store the e4m3 values as they are; the names differ by compressed-tensors version.
_FORMATS = ("float-quantized", "naive-quantized")
_STATIC_TENSOR_FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
# Keys that must be absent or null (or, for symmetric, true) in a per-tensor FP8 scheme.
_NULL_KEYS = ("group_size", "block_structure", "actorder")


def parse(qc: dict[str, Any], file: str = "config.json") -> QuantScheme:
    p = "quantization_config."
    fmt = qc.get("format")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise unsupported(p + "config_groups", groups, file)
    if fmt not in _FORMATS and not (
        fmt == "mixed-precision" and all(isinstance(g, dict) and g.get("format") for g in groups.values())
    ):
        raise unsupported(p + "format", fmt, file)
    for name, group in groups.items():
        _check_group(group, f"{p}config_groups.{name}.", file)
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise unsupported(p + key, qc[key], file)
    kv_cache = None
    kv = qc.get("kv_cache_scheme")
    if kv is not None:
        _check_args(kv, p + "kv_cache_scheme.", file)
        kv_cache = "FP8"
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(n, str) for n in ignore):
        raise CheckpointError(f'{file}: {p}ignore must be a list of module names or "re:" patterns, got {ignore!r}')
    return QuantScheme(FORMAT, file, tuple(ignore), kv_cache)


def _check_group(group: object, prefix: str, file: str) -> None:
    if not isinstance(group, dict):
        raise unsupported(prefix.rstrip("."), group, file)
    if group.get("format") is not None and group["format"] not in _FORMATS:
        raise unsupported(prefix + "format", group["format"], file)
    for key in ("weights", "input_activations"):
        if group.get(key) is None:
            # No input_activations means weight-only FP8: no static input scale to run with.
            raise unsupported(prefix + key, None, file)
        _check_args(group[key], f"{prefix}{key}.", file)
    if group.get("output_activations") is not None:
        raise unsupported(prefix + "output_activations", group["output_activations"], file)


def _check_args(args: object, prefix: str, file: str) -> None:
    if not isinstance(args, dict):
        raise unsupported(prefix.rstrip("."), args, file)
    for key, expected in _STATIC_TENSOR_FP8.items():
        value = args.get(key)
        if isinstance(value, str):
            value = value.lower()
        if value != expected:
            raise unsupported(prefix + key, args.get(key), file)
    if args.get("symmetric", True) is not True:
        raise unsupported(prefix + "symmetric", args["symmetric"], file)
    for key in _NULL_KEYS:
        if args.get(key) is not None:
            raise unsupported(prefix + key, args[key], file)


def _args() -> dict[str, Any]:
    return {
        **_STATIC_TENSOR_FP8,
        "symmetric": True,
        "group_size": None,
        "block_structure": None,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def quantization_config(ignore: Sequence[str], kv_cache: bool = False) -> dict[str, Any]:
    """config.json's quantization_config for a static per-tensor FP8 checkpoint; kv_cache: with
    per-tensor FP8 K/V cache scales (`<attn>.k_scale` / `<attn>.v_scale` tensors)."""
    group = {
        "targets": ["Linear"],
        "weights": _args(),
        "input_activations": _args(),
        "output_activations": None,
        "format": "float-quantized",
    }
    return {
        "quant_method": FORMAT,
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": list(ignore),
        "kv_cache_scheme": {**_STATIC_TENSOR_FP8, "symmetric": True} if kv_cache else None,
        "sparsity_config": {},
        "global_compression_ratio": None,
    }
