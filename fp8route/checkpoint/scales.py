"""A linear's scale tensors as each scheme stores them in a checkpoint, checked from the shard headers.

- tensor: `weight_scale` and, with a static input scale, `input_scale`: one value each, [] or [1];
- channel: `weight_scale` [N] (ModelOpt) or [N, 1] (compressed-tensors, often bf16); no input_scale;
- block: `weight_scale` (compressed-tensors, ModelOpt) or `weight_scale_inv` (quant_method fp8)
  [ceil(N/128), ceil(K/128)], or ModelOpt FP8_PB_WO's [ceil(N/128), 1, ceil(K/128), 1]; no input_scale.

Every disagreement is one line naming the tensor, its shape and file, the config key and value that
chose the scheme, and what was expected. An input_scale in a checkpoint whose config says its input
is quantized dynamically is refused rather than ignored: the config and the tensors disagree about
how the model was calibrated, and either could be the one that is wrong.
"""

from __future__ import annotations

from fp8route.checkpoint.formats import QuantScheme, modelopt
from fp8route.checkpoint.shards import TensorInfo
from fp8route.errors import CheckpointError
from fp8route.schemes import BLOCK, cdiv

SCALE_NAMES = ("weight_scale", "weight_scale_inv")
FLOAT_SCALE_DTYPES = ("F32", "BF16", "F16")


def weight_scale_shapes(scheme: QuantScheme, n: int, k: int) -> tuple[tuple[int, ...], ...]:
    """The shapes a [N, K] weight's scale may have in a checkpoint of scheme."""
    if scheme.fp8_scheme == "tensor":
        return ((), (1,))
    if scheme.fp8_scheme == "channel":
        return ((n,), (n, 1))
    blocks = (cdiv(n, BLOCK), cdiv(k, BLOCK))
    if scheme.format == modelopt.FORMAT:
        return (blocks, (blocks[0], 1, blocks[1], 1))  # FP8_PB_WO's own layout
    return (blocks,)


def _what(scheme: QuantScheme, n: int, k: int) -> str:
    return {
        "tensor": "one value",
        "channel": f"one per output row of the [{n}, {k}] weight",
        "block": f"one per {BLOCK}x{BLOCK} block of the [{n}, {k}] weight, partial edge blocks included",
    }[scheme.fp8_scheme]


def check_scales(module: str, parts: dict[str, TensorInfo], weight: TensorInfo, scheme: QuantScheme) -> None:
    """The weight scale, input scale and zero points of the FP8 linear `module` against scheme."""
    scale = _weight_scale(module, parts, weight, scheme)
    n, k = weight.shape
    expected = weight_scale_shapes(scheme, n, k)
    if scale.shape not in expected:
        shapes = " or ".join(str(list(s)) for s in expected)
        raise CheckpointError(
            f"{scale.where} has shape {list(scale.shape)} but {scheme.origin} ({scheme.description}) expects "
            f"{shapes}: {_what(scheme, n, k)}"
        )
    check_float_scale(scale)
    _check_input_scale(module, parts, weight, scheme)
    zero = parts.get("weight_zero_point")
    if zero is not None and zero.numel != scale.numel:
        raise CheckpointError(
            f"unsupported: {zero.where} has shape {list(zero.shape)}; symmetric FP8 has one zero point (of 0) per "
            f"weight scale, and {scale.name} has shape {list(scale.shape)}"
        )


def _weight_scale(module: str, parts: dict[str, TensorInfo], weight: TensorInfo, scheme: QuantScheme) -> TensorInfo:
    name = scheme.scale_name
    other = next(s for s in SCALE_NAMES if s != name)
    if other in parts:
        inv = " (weight_scale_inv is the block scale of quant_method fp8 checkpoints with weight_block_size)"
        raise CheckpointError(
            f"{parts[other].where}: {scheme.origin} ({scheme.description}) names each linear's weight scale "
            f"{name}, not {other}" + (inv if other == "weight_scale_inv" else "")
        )
    if name not in parts:
        raise CheckpointError(
            f"missing {module}.{name}: {weight.where} is FP8 but has no {name} in any shard "
            f"({scheme.origin}: every FP8 linear has one)"
        )
    return parts[name]


def _check_input_scale(module: str, parts: dict[str, TensorInfo], weight: TensorInfo, scheme: QuantScheme) -> None:
    info = parts.get("input_scale")
    if scheme.static_input:
        if info is None:
            raise CheckpointError(
                f"missing {module}.input_scale: {weight.where} is FP8 but has no input_scale in any shard "
                f"({scheme.origin}: a static input scale for every linear)"
            )
        check_scalar(info)
        zero = parts.get("input_zero_point")
        if zero is not None and zero.numel != 1:
            raise CheckpointError(
                f"unsupported: {zero.where} has shape {list(zero.shape)}; a per-tensor input scale has one zero point"
            )
        return
    stray = info or parts.get("input_zero_point")
    if stray is not None:
        what = "scale" if stray is info else "zero point"
        raise CheckpointError(
            f"{stray.where} is a static input {what} but {scheme.origin} says {scheme.description}: x is "
            "quantized at run time, so the tensor would go unused; remove it, or fix the config if the "
            "checkpoint was calibrated for static input scales"
        )


def check_scalar(info: TensorInfo) -> None:
    """A per-tensor scale (an input scale, a KV-cache scale): one float value."""
    if info.numel != 1:
        raise CheckpointError(
            f"unsupported: {info.where} has shape {list(info.shape)}; expected one per-tensor scale of shape [] or [1]"
        )
    check_float_scale(info)


def check_float_scale(info: TensorInfo) -> None:
    if info.dtype not in FLOAT_SCALE_DTYPES:
        raise CheckpointError(f"{info.where}: expected a float32/bfloat16/float16 scale, got {info.dtype_name}")
