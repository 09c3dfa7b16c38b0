"""quant_method "fp8": DeepSeek-V3's and Qwen3's official *-FP8 checkpoints, transformers'
FineGrainedFP8Config, vLLM's Fp8Config.

    {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
     "fmt": "e4m3", "modules_to_not_convert": [...]}

With weight_block_size, every linear has an e4m3 `weight` and an fp32 `weight_scale_inv`
[ceil(N/128), ceil(K/128)] (a multiplier despite its name) and x is quantized per 1x128 group at run
time: the block scheme. Only [128, 128] blocks are served. Without it the scales are per tensor:
`weight_scale`, and `input_scale` when activation_scheme is "static" (dynamic: none, x scaled per
tensor at run time).

vLLM's Fp8Config reads quant_method, activation_scheme (required), weight_block_size,
ignored_layers and, when that is empty, modules_to_not_convert; transformers reads
modules_to_not_convert (ignored_layers in its place), weight_block_size, activation_scheme, and
scale_fmt and dequantize, neither of which changes what the tensors mean. "fmt" is what the
DeepSeek-V3 and Qwen3 configs add; neither loader reads it. Neither loader quantizes lm_head (vLLM's
ParallelLMHead is not a linear it converts; transformers adds the output embedding to the modules it
leaves), so it is excluded here without being listed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fp8route.checkpoint.formats.scheme import QuantScheme, unsupported
from fp8route.errors import CheckpointError
from fp8route.schemes import BLOCK

FORMAT = "fp8"
SCALE_INV = "weight_scale_inv"
_ACTIVATION_SCHEMES = ("static", "dynamic")
_EXCLUDE_KEYS = ("ignored_layers", "modules_to_not_convert")
_IMPLIED_EXCLUDE = "lm_head"
_SCALE_FORMATS = (None, "float", "ue8m0")  # ue8m0: fp32 scales that are powers of two (DeepSeek-V3.1)


def parse(qc: dict[str, Any], file: str = "config.json") -> QuantScheme:
    p = "quantization_config."
    activation = qc.get("activation_scheme")
    if activation not in _ACTIVATION_SCHEMES:
        raise unsupported(p + "activation_scheme", activation, file, 'expected "static" or "dynamic"')
    fmt = qc.get("fmt")
    if fmt is not None and str(fmt).lower() != "e4m3":
        raise unsupported(p + "fmt", fmt, file)
    if qc.get("scale_fmt") not in _SCALE_FORMATS:
        raise unsupported(p + "scale_fmt", qc.get("scale_fmt"), file)
    exclude = tuple(dict.fromkeys((*_exclusions(qc, p, file), _IMPLIED_EXCLUDE)))
    block = qc.get("weight_block_size")
    if block is None:
        origin = f"{p}activation_scheme={activation} in {file} (no weight_block_size: per-tensor scales)"
        return QuantScheme(FORMAT, file, exclude, None, "tensor", activation == "static", origin=origin)
    _check_block(block, p + "weight_block_size", file)
    if activation != "dynamic":
        raise unsupported(
            p + "activation_scheme", activation, file, "block-scaled weights run with dynamic 1x128 input groups"
        )
    origin = f"{p}weight_block_size={block} in {file}"
    return QuantScheme(FORMAT, file, exclude, None, "block", False, SCALE_INV, origin=origin)


def _check_block(block: object, key: str, file: str) -> None:
    sizes = list(block) if isinstance(block, (list, tuple)) else []
    if len(sizes) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
        raise CheckpointError(
            f"{key}={block!r} in {file} is malformed: expected two positive integers [rows, columns], e.g. "
            f"[{BLOCK}, {BLOCK}]"
        )
    if sizes != [BLOCK, BLOCK]:
        raise unsupported(
            key,
            sizes,
            file,
            f"fp8route serves {BLOCK}x{BLOCK} blocks only (DeepSeek-V3, Qwen3-FP8, llm-compressor FP8_BLOCK); "
            "quantize the bf16 model with `fp8route quantize SRC DST --scheme block`",
        )


def _exclusions(qc: dict[str, Any], p: str, file: str) -> tuple[str, ...]:
    names: list[str] = []
    for key in _EXCLUDE_KEYS:
        value = qc.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
            raise CheckpointError(f"{file}: {p}{key} must be a list of module names, got {value!r}")
        names += value
    return tuple(names)


def quantization_config(exclude: Sequence[str]) -> dict[str, Any]:
    """config.json's quantization_config for a 128x128 block checkpoint (`weight_scale_inv` tensors),
    as Qwen3's *-FP8 write it; the exclusions under both names vLLM reads (an older vLLM reads
    ignored_layers alone, transformers modules_to_not_convert)."""
    return {
        "quant_method": FORMAT,
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "fmt": "e4m3",
        "ignored_layers": list(exclude),
        "modules_to_not_convert": list(exclude),
    }
