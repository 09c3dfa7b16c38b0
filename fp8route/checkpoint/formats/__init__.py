"""Checkpoint quantization configs (ModelOpt, compressed-tensors, quant_method "fp8") -> one
canonical QuantScheme, whose fp8_scheme is one of fp8route.schemes' three: per tensor, per channel
(dynamic per-token input) or 128x128 blocks (dynamic 1x128 input groups).

The formats store the same e4m3 `weight` for every scheme; they differ in where the config lives,
how exclusions are written and what the scales are called and shaped (formats' own modules say).
A config fp8route cannot run is refused here, in one line naming the key, its value and the file,
before a tensor is read. Which scheme each format is written in by `fp8route quantize` is here too.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from fp8route.checkpoint.formats import compressed_tensors, fp8, modelopt
from fp8route.checkpoint.formats.scheme import QuantScheme, describe, unsupported
from fp8route.errors import CheckpointError, Fp8InputError
from fp8route.schemes import Scheme

CONFIG = "config.json"
FORMATS = ("modelopt", "compressed-tensors", "fp8")
# What `fp8route quantize` writes: each scheme's default format, and why the other pairs are not written.
DEFAULT_FORMAT: dict[Scheme, str] = {"tensor": "modelopt", "channel": "compressed-tensors", "block": "fp8"}
NOT_WRITTEN: dict[tuple[str, Scheme], str] = {
    ("modelopt", "block"): "ModelOpt's block form, FP8_PB_WO, is weight-only by name and vLLM takes it only when "
    "every N and K is a multiple of 128; write block checkpoints with --format fp8 (DeepSeek-V3/Qwen3) or "
    "compressed-tensors (FP8_BLOCK)",
    ("fp8", "tensor"): "quant_method fp8 is written for block checkpoints only; write per-tensor ones with --format "
    "modelopt or compressed-tensors",
    ("fp8", "channel"): "quant_method fp8 has no per-channel form; write channel checkpoints with --format "
    "compressed-tensors (FP8_DYNAMIC) or modelopt (FP8_PER_CHANNEL_PER_TOKEN)",
}


def read_json(path: Path) -> dict[str, Any]:
    if not path.parent.is_dir():
        what = "a file" if path.parent.exists() else "not there"
        raise CheckpointError(f"{path.parent} is {what}: expected a checkpoint folder holding {path.name}")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path.name} not found in {path.parent}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path.name} in {path.parent} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path.name} in {path.parent}: expected a JSON object, got {type(data).__name__}")
    return data


def written_format(format: str | None, scheme: Scheme) -> str:
    """The format a checkpoint of scheme is written in: format, checked, or the scheme's default."""
    if format is None:
        return DEFAULT_FORMAT[scheme]
    if format not in FORMATS:
        raise Fp8InputError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    reason = NOT_WRITTEN.get((format, scheme))
    if reason is not None:
        raise Fp8InputError(f"format {format} with scheme {scheme} is not written: {reason}")
    return format


def detect_scheme(folder: Path, config: dict[str, Any]) -> QuantScheme:
    """The quantization scheme of a checkpoint folder, from config.json's quantization_config
    and/or ModelOpt's hf_quant_config.json (both are read and must agree)."""
    schemes = []
    qc = config.get("quantization_config")
    if qc is not None:
        if not isinstance(qc, dict):
            raise unsupported("quantization_config", qc, CONFIG)
        method = str(qc.get("quant_method", "")).lower()
        if method.startswith("modelopt"):
            schemes.append(modelopt.parse_config_json(qc, CONFIG))
        elif method == "compressed-tensors":
            schemes.append(compressed_tensors.parse(qc, CONFIG))
        elif method == fp8.FORMAT:
            schemes.append(fp8.parse(qc, CONFIG))
        else:
            raise unsupported("quantization_config.quant_method", qc.get("quant_method"), CONFIG)
    legacy = folder / modelopt.HF_QUANT_CONFIG
    if legacy.is_file():
        schemes.append(modelopt.parse_hf_quant_config(read_json(legacy), modelopt.HF_QUANT_CONFIG))
    if not schemes:
        raise CheckpointError(
            f"{folder}: no quantization config (neither quantization_config in {CONFIG} nor "
            f"{modelopt.HF_QUANT_CONFIG}); this is not an FP8 checkpoint. "
            "Make one with `fp8route quantize SRC DST`."
        )
    if len({s.format for s in schemes}) > 1:
        raise CheckpointError(
            f"{folder}: {schemes[0].source} says {schemes[0].format} but {schemes[1].source} says {schemes[1].format}"
        )
    first = schemes[0]
    if len(schemes) == 1:
        return first
    second = schemes[1]
    if (first.fp8_scheme, first.static_input) != (second.fp8_scheme, second.static_input):
        raise CheckpointError(
            f"{folder}: {first.origin} says {first.description} but {second.origin} says {second.description}"
        )
    exclude = tuple(dict.fromkeys(p for s in schemes for p in s.exclude))
    kv_cache = next((s.kv_cache for s in schemes if s.kv_cache), None)
    return replace(first, source=" + ".join(s.source for s in schemes), exclude=exclude, kv_cache=kv_cache)


__all__ = [
    "CONFIG",
    "DEFAULT_FORMAT",
    "FORMATS",
    "QuantScheme",
    "describe",
    "detect_scheme",
    "read_json",
    "unsupported",
    "written_format",
]
