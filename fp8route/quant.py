"""Per-tensor FP8 (e4m3) numerics: quantize, dequantize, requantize fused shards, check scales."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fp8route.errors import Fp8InputError, Fp8TypeError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# A zero tensor still needs a usable scale; any positive value quantizes it to zeros.
_MIN_SCALE = 1e-12
# e4m3fn has no infinities; S.1111.111 is its only NaN encoding.
E4M3_NAN_BITS = 0x7F


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": how tables, reports and the command line spell dtypes."""
    return str(dtype).removeprefix("torch.")


FLOAT_DTYPE_NAMES = {dtype_name(d): d for d in FLOAT_DTYPES}


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise Fp8TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise Fp8TypeError(f"{name}: expected bfloat16, float16 or float32, got {t.dtype}")


def check_fp8_weight(name: str, w: torch.Tensor) -> None:
    if not isinstance(w, torch.Tensor):
        raise Fp8TypeError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype != FP8_DTYPE:
        raise Fp8TypeError(f"{name}: expected dtype float8_e4m3fn, got {w.dtype}")
    if w.dim() != 2:
        raise Fp8InputError(f"{name}: expected a 2-D [N, K] weight, got shape {tuple(w.shape)}")


def check_fp8_finite(name: str, w: torch.Tensor) -> None:
    """Raise Fp8InputError if the e4m3 tensor w holds NaN. Reads on the host: load time only."""
    nan = (w.view(torch.uint8) & E4M3_NAN_BITS) == E4M3_NAN_BITS
    if bool(nan.any()):
        raise Fp8InputError(f"{name}: {int(nan.sum())} NaN value(s) in the FP8 weight")


def check_finite(name: str, t: torch.Tensor) -> None:
    """Raise Fp8InputError if the float tensor t holds NaN or Inf. Reads on the host: load time only."""
    if not bool(torch.isfinite(t).all()):
        raise Fp8InputError(f"{name}: {int((~torch.isfinite(t)).sum())} NaN or Inf value(s); expected finite values")


def as_scale(name: str, scale: torch.Tensor | float, device: torch.device | None = None) -> torch.Tensor:
    """Validate one per-tensor scale and return it as a 0-dim fp32 tensor.

    Checkpoints store scales as [] or [1], in fp32, bf16 or fp16; all of them mean one number.
    This reads the value on the host, so call it at load time, never in forward.
    """
    if isinstance(scale, (int, float)):
        scale = torch.tensor(float(scale), dtype=torch.float32)
    if not isinstance(scale, torch.Tensor):
        raise Fp8TypeError(f"{name}: expected a tensor or a float, got {type(scale).__name__}")
    if scale.numel() != 1:
        raise Fp8InputError(f"{name}: expected one per-tensor scale (shape [] or [1]), got shape {tuple(scale.shape)}")
    if not scale.dtype.is_floating_point or scale.dtype in (FP8_DTYPE, torch.float8_e5m2):
        raise Fp8TypeError(f"{name}: expected a float32/bfloat16/float16 scale, got {scale.dtype}")
    value = float(scale.detach().float().cpu().reshape(()))
    if not torch.isfinite(torch.tensor(value)) or value <= 0.0:
        raise Fp8InputError(f"{name}: a scale must be finite and > 0, got {value}")
    return scale.detach().reshape(()).to(device=device or scale.device, dtype=torch.float32)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, saturated to +-448 and rounded to nearest even e4m3. Graph-safe: no host sync."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_by_inverse(x: torch.Tensor, scale: float) -> torch.Tensor:
    """quantize with a float scale as the KV cache's kernels do it: x times 1 / scale, so the torch
    paths round exactly as they do."""
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dynamic_scale(x: torch.Tensor) -> torch.Tensor:
    """The per-tensor scale amax/448 of x, as a 0-dim fp32 tensor on x's device."""
    return (x.detach().abs().amax().float() / FP8_MAX).clamp(min=_MIN_SCALE)


def quantize_per_tensor(
    x: torch.Tensor, scale: torch.Tensor | None = None, *, name: str = "x"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float tensor to e4m3 with one scale (amax/448 when none is given); name is what
    an error calls x. Checks x is finite on the host: for weights at load time, not activations."""
    check_float(name, x)
    if scale is None:
        scale = dynamic_scale(x)
        # amax propagates NaN and Inf, so a finite scale vouches for every element without another pass.
        finite = bool(torch.isfinite(scale))
    else:
        scale = as_scale(f"{name} scale", scale, x.device)
        finite = bool(torch.isfinite(x).all())
    if not finite:
        check_finite(name, x)
    return quantize(x, scale), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)


@dataclass(frozen=True)
class Requantized:
    """A fused weight whose shards now share one scale, and what that cost."""

    weight: torch.Tensor
    scale: torch.Tensor
    max_abs_error: float  # in weight units, against the shards dequantized with their own scales
    rel_error: float  # ||requantized - original|| / ||original|| over the fused weight


def requantize_shards(
    weight: torch.Tensor, scales: Sequence[torch.Tensor], logical_widths: Sequence[int]
) -> Requantized:
    """Bring shards (q/k/v, gate/up) that carry their own scales onto the largest one.

    The largest scale keeps every shard inside e4m3's range; shards with smaller scales lose a
    little precision, which is reported rather than hidden.
    """
    check_fp8_weight("weight", weight)
    if len(scales) != len(logical_widths):
        raise Fp8InputError(f"requantize: {len(scales)} scales for {len(logical_widths)} logical widths")
    if sum(logical_widths) != weight.shape[0]:
        raise Fp8InputError(
            f"requantize: logical widths {list(logical_widths)} sum to {sum(logical_widths)}, "
            f"weight has N={weight.shape[0]}"
        )
    checked = [as_scale(f"shard {i} weight_scale", s, weight.device) for i, s in enumerate(scales)]
    max_scale = torch.stack(checked).max()
    original = torch.cat([dequantize(w, s) for w, s in zip(weight.split(list(logical_widths)), checked)])
    requantized = quantize(original, max_scale)
    diff = dequantize(requantized, max_scale) - original
    norm = original.norm().item()
    return Requantized(
        weight=requantized,
        scale=max_scale,
        max_abs_error=diff.abs().max().item() if diff.numel() else 0.0,
        rel_error=diff.norm().item() / norm if norm > 0 else 0.0,
    )


def sqnr_db(signal: torch.Tensor, noisy: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (torchao's accuracy measure)."""
    s = signal.double()
    noise = (s - noisy.double()).norm()
    return float("inf") if noise == 0 else float(20 * torch.log10(s.norm() / noise))
