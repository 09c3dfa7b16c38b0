"""compressed-tensors (llm-compressor) FP8: config.json's quantization_config with quant_method
"compressed-tensors", format float-quantized or naive-quantized, and config_groups whose weights and
input_activations are {num_bits: 8, type: float, symmetric: true}, in one of three pairings:

- weights strategy tensor, inputs strategy tensor: the tensor scheme, with a static input_scale
  (dynamic false: llm-compressor's FP8) or none (dynamic true);
- weights strategy channel, inputs strategy token, dynamic true: the channel scheme (FP8_DYNAMIC,
  the RedHatAI *-FP8-dynamic models; weight_scale [N, 1], in the model's dtype);
- weights strategy block, block_structure [128, 128], inputs strategy group, group_size 128, dynamic
  true: the block scheme (FP8_BLOCK; weight_scale [ceil(N/128), ceil(K/128)]).

vLLM's CompressedTensorsConfig reads quant_method, format, ignore, config_groups (each group's targets,
weights, input_activations and format), kv_cache_scheme, sparsity_config and transform_config; each
args object is compressed-tensors' QuantizationArgs. quantization_status and global_compression_ratio
are compressed-tensors' own (its ModelCompressor reads them), and are not checked here: the tensors'
dtypes say whether the weights are compressed.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from fp8route.checkpoint.formats.scheme import QuantScheme, describe, unsupported
from fp8route.errors import CheckpointError
from fp8route.schemes import BLOCK, Scheme

FORMAT = "compressed-tensors"
# Both store the e4m3 values as they are; the names differ by compressed-tensors version.
_FORMATS = ("float-quantized", "naive-quantized")
_FP8 = {"num_bits": 8, "type": "float"}
_STATIC_TENSOR_FP8 = {**_FP8, "strategy": "tensor", "dynamic": False}
_BLOCK_STRUCTURE = [BLOCK, BLOCK]
# Per weights strategy: the inputs strategy and dynamic it runs with, and what the messages call it.
_INPUTS: dict[str, tuple[str, str]] = {
    "tensor": ("tensor", "input_activations strategy tensor (dynamic false or true)"),
    "channel": ("token", "input_activations strategy token, dynamic true (FP8_DYNAMIC)"),
    "block": ("group", "input_activations strategy group, group_size 128, dynamic true (FP8_BLOCK)"),
}


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
    found = {name: _group(group, f"{p}config_groups.{name}.", file) for name, group in groups.items()}
    scheme, static, origin = _one_scheme(found, p, file)
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise unsupported(p + key, qc[key], file)
    kv_cache = None
    kv = qc.get("kv_cache_scheme")
    if kv is not None:
        _check_kv(kv, p + "kv_cache_scheme.", file)
        kv_cache = "FP8"
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(n, str) for n in ignore):
        raise CheckpointError(f'{file}: {p}ignore must be a list of module names or "re:" patterns, got {ignore!r}')
    return QuantScheme(FORMAT, file, tuple(ignore), kv_cache, scheme, static, origin=origin)


def _one_scheme(found: dict[str, tuple[Scheme, bool, str]], p: str, file: str) -> tuple[Scheme, bool, str]:
    (first, (scheme, static, origin)), *rest = found.items()
    for name, (other, other_static, _) in rest:
        if (other, other_static) != (scheme, static):
            raise CheckpointError(
                f"{file}: {p}config_groups.{first} is {describe(scheme, static)} but {p}config_groups.{name} is "
                f"{describe(other, other_static)}; fp8route runs one FP8 scheme per checkpoint (quantize the model "
                "again with one scheme for every linear)"
            )
    return scheme, static, origin


def _group(group: object, prefix: str, file: str) -> tuple[Scheme, bool, str]:
    """A config group's (scheme, static input scale, origin), or the one line saying why it is not served."""
    if not isinstance(group, dict):
        raise unsupported(prefix.rstrip("."), group, file)
    if group.get("format") is not None and group["format"] not in _FORMATS:
        raise unsupported(prefix + "format", group["format"], file)
    if group.get("output_activations") is not None:
        raise unsupported(prefix + "output_activations", group["output_activations"], file)
    for key in ("weights", "input_activations"):
        if group.get(key) is None:
            # No input_activations means weight-only FP8 (W8A16), which no fp8route scheme computes.
            raise unsupported(prefix + key, None, file)
        _check_fp8(group[key], f"{prefix}{key}.", file)
    weights, inputs = group["weights"], group["input_activations"]
    w = prefix + "weights."
    if _lower(weights.get("dynamic", False)) is not False:
        raise unsupported(w + "dynamic", weights["dynamic"], file)
    strategy = _strategy(weights, w, file)
    if strategy not in _INPUTS:
        raise unsupported(w + "strategy", weights.get("strategy"), file)
    _check_extent(weights, w, file, "block_structure", _BLOCK_STRUCTURE if strategy == "block" else None)
    _check_extent(weights, w, file, "group_size", -1 if strategy == "channel" else None)
    static = _check_inputs(inputs, prefix + "input_activations.", file, strategy)
    return strategy, static, f"{w}strategy={strategy} in {file}"  # type: ignore[return-value]


def _check_inputs(inputs: dict[str, Any], prefix: str, file: str, weights: str) -> bool:
    """Whether the inputs, which must pair with `weights` strategy weights, have a static scale."""
    expected, wanted = _INPUTS[weights]
    why = f"{weights} weights run with {wanted}"
    strategy = _strategy(inputs, prefix, file)
    if strategy != expected:
        raise unsupported(prefix + "strategy", inputs.get("strategy"), file, why)
    dynamic = _lower(inputs.get("dynamic", False))
    if not isinstance(dynamic, bool) or (weights != "tensor" and dynamic is not True):
        raise unsupported(prefix + "dynamic", inputs.get("dynamic"), file, why)
    _check_extent(inputs, prefix, file, "group_size", BLOCK if strategy == "group" else None)
    _check_extent(inputs, prefix, file, "block_structure", None)
    return not dynamic


def _strategy(args: dict[str, Any], prefix: str, file: str) -> str:
    """args' strategy as compressed-tensors infers it when absent (group_size None: tensor, -1: channel)."""
    strategy = _lower(args.get("strategy"))
    if strategy is None:
        size = args.get("group_size")
        strategy = "tensor" if size is None else "channel" if size == -1 else None
    if not isinstance(strategy, str):
        raise unsupported(prefix + "strategy", args.get("strategy"), file)
    return strategy


def _check_extent(args: dict[str, Any], prefix: str, file: str, key: str, allowed: object) -> None:
    """group_size / block_structure: absent or null, or (where the strategy has one) the value served."""
    value = args.get(key)
    if value is not None and value != allowed:
        raise unsupported(prefix + key, value, file)


def _check_fp8(args: object, prefix: str, file: str) -> None:
    if not isinstance(args, dict):
        raise unsupported(prefix.rstrip("."), args, file)
    for key, expected in _FP8.items():
        if _lower(args.get(key)) != expected:
            raise unsupported(prefix + key, args.get(key), file)
    if args.get("symmetric", True) is not True:
        raise unsupported(prefix + "symmetric", args["symmetric"], file)
    if args.get("actorder") is not None:
        raise unsupported(prefix + "actorder", args["actorder"], file)


def _check_kv(args: object, prefix: str, file: str) -> None:
    """kv_cache_scheme: one static fp32 scale per layer for K and one for V."""
    _check_fp8(args, prefix, file)
    assert isinstance(args, dict)
    for key, expected in _STATIC_TENSOR_FP8.items():
        if _lower(args.get(key)) != expected:
            raise unsupported(prefix + key, args.get(key), file)
    for key in ("group_size", "block_structure"):
        _check_extent(args, prefix, file, key, None)


def _lower(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


def _args(strategy: str, dynamic: bool, **extent: object) -> dict[str, Any]:
    """One QuantizationArgs as compressed-tensors serializes it (none of the keys it added later,
    scale_dtype and zp_dtype, which the QuantizationArgs of older vLLM releases would refuse)."""
    return {
        **_FP8,
        "symmetric": True,
        "group_size": extent.get("group_size"),
        "strategy": strategy,
        "block_structure": extent.get("block_structure"),
        "dynamic": dynamic,
        "actorder": None,
        "observer": None if dynamic else "minmax",
        "observer_kwargs": {},
    }


_WRITTEN: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tensor": (_args("tensor", False), _args("tensor", False)),
    "channel": (_args("channel", False), _args("token", True)),
    "block": (_args("block", False, block_structure=_BLOCK_STRUCTURE), _args("group", True, group_size=BLOCK)),
}


def quantization_config(ignore: Sequence[str], kv_cache: bool = False, scheme: Scheme = "tensor") -> dict[str, Any]:
    """config.json's quantization_config for an FP8 checkpoint of scheme as llm-compressor writes it:
    FP8 (static per tensor), FP8_DYNAMIC (channel) or FP8_BLOCK (block); kv_cache: with per-tensor FP8
    K/V cache scales (`<attn>.k_scale` / `<attn>.v_scale` tensors)."""
    weights, inputs = _WRITTEN[scheme]
    group = {
        "targets": ["Linear"],
        "weights": copy.deepcopy(weights),
        "input_activations": copy.deepcopy(inputs),
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
