"""quantize_model: a float transformers model -> calibrated static per-tensor FP8 linears, in place.

Each linear's input scale is amax(|input|) / 448 over the calibration tokens, observed by forward
pre-hooks while the float model runs them; its weight is quantized per tensor (amax / 448), as
fp8route.quantize_checkpoint does for checkpoints on disk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from fp8route.checkpoint.formats import QuantScheme
from fp8route.errors import Fp8InputError
from fp8route.hf.config import Fp8RouteConfig
from fp8route.hf.modules import set_module
from fp8route.linear.layer import Fp8Linear
from fp8route.quant import FP8_MAX

_MIN_AMAX = 1e-6  # a linear whose input was all zeros still needs a positive scale

Calibration = torch.Tensor | Sequence[torch.Tensor]


def quantize_model(
    model: PreTrainedModel, calib: Calibration, *, exclude: Sequence[str] = ("lm_head",)
) -> PreTrainedModel:
    """Replace every nn.Linear of model (bf16/fp16/fp32) by an Fp8Linear with a calibrated static
    input scale, except those matching exclude (names or fnmatch wildcards; lm_head by default)
    and linears whose weight is tied to another module's (a tied lm_head). calib: token ids, a
    [B, T] int64 tensor (run as one batch) or a list of 1-D tensors (run one at a time).

    The model's config gets an Fp8RouteConfig naming what stayed in float, so model.save_pretrained
    (or fp8route.hf.save_pretrained) writes a ModelOpt FP8 checkpoint. Returns the model."""
    batches = _batches(calib)
    matcher = QuantScheme("modelopt", "exclude", tuple(exclude))
    tied = _tied_weights(model)
    targets: dict[str, nn.Linear] = {}
    kept: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            if matcher.excludes(name) or id(module.weight) in tied:
                kept.append(name)
            else:
                targets[name] = module
    if not targets:
        raise Fp8InputError(f"quantize_model: no nn.Linear left to quantize (exclude={list(exclude)})")
    amax = _calibrate(model, targets, batches)
    unseen = sorted(set(targets) - set(amax))
    if unseen:
        raise Fp8InputError(
            f"quantize_model: the calibration never ran {len(unseen)} linear(s) ({', '.join(unseen[:4])}); "
            "exclude them or calibrate with inputs that reach them"
        )
    for name, linear in targets.items():
        scale = max(amax[name], _MIN_AMAX) / FP8_MAX
        set_module(model, name, Fp8Linear.from_float(linear, input_scale=scale, name=name))
    model.config.quantization_config = Fp8RouteConfig(exclude=sorted(kept))
    return model


def _batches(calib: Calibration) -> list[torch.Tensor]:
    if isinstance(calib, torch.Tensor):
        batches = [calib] if calib.dim() == 2 else [calib[None]] if calib.dim() == 1 else []
    else:
        batches = [torch.as_tensor(t)[None] for t in calib]
    if not batches or any(b.dim() != 2 or b.numel() == 0 for b in batches):
        raise Fp8InputError(
            "quantize_model: calib must be a [B, T] tensor or a non-empty list of non-empty 1-D tensors of token ids"
        )
    if any(b.dtype not in (torch.int64, torch.int32) for b in batches):
        raise Fp8InputError(f"quantize_model: calib token ids must be int64, got {batches[0].dtype}")
    return batches


def _tied_weights(model: nn.Module) -> set[int]:
    """ids of the weights that more than one module holds (an lm_head tied to the embedding)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            holders[id(weight)] = holders.get(id(weight), 0) + 1
    return {key for key, count in holders.items() if count > 1}


def _calibrate(model: nn.Module, targets: dict[str, nn.Linear], batches: list[torch.Tensor]) -> dict[str, float]:
    """amax of each target's input over the batches, from forward pre-hooks removed afterwards."""
    amax: dict[str, float] = {}

    def hook(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def record(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            amax[name] = max(amax.get(name, 0.0), args[0].detach().abs().max().item())

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in targets.items()]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                model(input_ids=batch.to(device, torch.int64), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return amax
