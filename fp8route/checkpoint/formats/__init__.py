"""Checkpoint quantization configs (ModelOpt, compressed-tensors) -> one canonical QuantScheme.

Both formats store the same tensors for a per-tensor FP8 linear (`weight` in e4m3, scalar
`weight_scale` and `input_scale`); they differ in where the config lives and how exclusions are
written. Anything that is not static per-tensor FP8 is rejected here, before a tensor is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fp8route.checkpoint.formats import compressed_tensors, modelopt
from fp8route.checkpoint.formats.scheme import QuantScheme, unsupported
from fp8route.errors import CheckpointError

CONFIG = "config.json"
FORMATS = ("modelopt", "compressed-tensors")


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
        else:
            raise unsupported("quantization_config.quant_method", qc.get("quant_method"), CONFIG)
    legacy = folder / modelopt.HF_QUANT_CONFIG
    if legacy.is_file():
        schemes.append(modelopt.parse_hf_quant_config(read_json(legacy), modelopt.HF_QUANT_CONFIG))
    if not schemes:
        raise CheckpointError(
            f"{folder}: no quantization config (neither quantization_config in {CONFIG} nor "
            f"{modelopt.HF_QUANT_CONFIG}); this is not a per-tensor FP8 checkpoint. "
            "Make one with `fp8route quantize SRC DST --format modelopt`."
        )
    if len({s.format for s in schemes}) > 1:
        raise CheckpointError(
            f"{folder}: {schemes[0].source} says {schemes[0].format} but {schemes[1].source} says {schemes[1].format}"
        )
    first = schemes[0]
    if len(schemes) == 1:
        return first
    exclude = tuple(dict.fromkeys(p for s in schemes for p in s.exclude))
    kv_cache = next((s.kv_cache for s in schemes if s.kv_cache), None)
    return QuantScheme(first.format, " + ".join(s.source for s in schemes), exclude, kv_cache)


__all__ = ["CONFIG", "FORMATS", "QuantScheme", "detect_scheme", "read_json", "unsupported"]
