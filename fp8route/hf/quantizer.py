"""Fp8RouteHfQuantizer: transformers' loader hook that makes every FP8 linear an fp8route.Fp8Linear.

transformers builds the model on the meta device and calls the quantizer before and after it
loads the weights. Before, each linear the checkpoint stores in FP8 is replaced by a placeholder
without parameters, so transformers loads only the float tensors (embeddings, norms, lm_head and
other excluded linears) with its own dtype and device_map handling. After, fp8route's
load_checkpoint(fuse=False) reads and checks the FP8 tensors (q/k/v and gate/up stay separate,
as transformers' modules are) and each placeholder becomes its Fp8Linear, on the device of the
layer it sits in.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING, register_quantizer
from transformers.quantizers.base import HfQuantizer

from fp8route.checkpoint.config_check import check_config
from fp8route.checkpoint.formats import CONFIG, detect_scheme, read_json
from fp8route.checkpoint.layout import layout
from fp8route.checkpoint.load import load_checkpoint
from fp8route.checkpoint.shards import ShardSet
from fp8route.errors import CheckpointError
from fp8route.hf.config import REGISTERED_METHODS, Fp8RouteConfig
from fp8route.hf.modules import PendingFp8Linear, device_near, get_module, set_module


class Fp8RouteHfQuantizer(HfQuantizer):
    """Loads FP8 checkpoints (ModelOpt, compressed-tensors, quant_method fp8; any scheme) into Fp8Linear layers."""

    requires_calibration = False
    quantization_config: Fp8RouteConfig

    def __init__(self, quantization_config: Fp8RouteConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.folder: Path | None = None
        self.pending: list[str] = []

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to check: fp8route runs on any device (a reference GEMM where no FP8 kernel does)."""

    def _process_model_before_weight_loading(
        self, model: nn.Module, checkpoint_files: list[str] | None = None, **kwargs: Any
    ) -> nn.Module:
        if not checkpoint_files:
            raise CheckpointError(
                "fp8route's quantizer loads pre-quantized FP8 checkpoints only; this model has no checkpoint "
                "files (to quantize a float model, load it as usual and call fp8route.hf.quantize_model)"
            )
        folder = Path(checkpoint_files[0]).parent
        config = read_json(folder / CONFIG)
        scheme = detect_scheme(folder, config)
        shards = ShardSet.open(folder)
        lay = layout(shards, scheme, fuse=False)
        check_config(config, shards.tensors)
        for name, record in lay.linears.items():
            current = get_module(model, name, "the checkpoint's FP8 linear")
            if not isinstance(current, nn.Linear):
                raise CheckpointError(
                    f"{name} is stored in FP8 but is a {type(current).__name__} in {type(model).__name__}, "
                    "not an nn.Linear; fp8route replaces linear layers only"
                )
            n, k = record.weight.shape
            if (current.out_features, current.in_features) != (n, k):
                raise CheckpointError(
                    f"{record.weight.where}: shape [{n}, {k}] does not match the model's "
                    f"[{current.out_features}, {current.in_features}] (does config.json fit the weights?)"
                )
            set_module(model, name, PendingFp8Linear(name, k, n))
        self.folder, self.pending = folder, list(lay.linears)
        self.quantization_config.exclude = list(scheme.exclude)
        # The FP8 tensors (and any KV-cache scales) are fp8route's to read: not "unexpected" keys.
        ignored = [re.escape(info.name) for rec in lay.linears.values() for info in rec.parts.values()]
        ignored += [re.escape(info.name) for info in lay.kv_scales.values()]
        known = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
        model._keys_to_ignore_on_load_unexpected = set(known) | set(ignored)  # type: ignore[assignment]
        return model

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        if self.folder is None:
            return model
        devices = {name: device_near(model, name) for name in self.pending}
        most = Counter(devices.values()).most_common(1)
        checkpoint = load_checkpoint(self.folder, most[0][0] if most else "cpu", fuse=False)
        for name, layer in checkpoint.linears.items():
            if name in devices:
                set_module(model, name, layer.to(devices[name]))
        left = [n for n in self.pending if isinstance(model.get_submodule(n), PendingFp8Linear)]
        if left:
            raise CheckpointError(f"{self.folder}: no FP8 tensors were read for {', '.join(left[:5])}")
        self.pending = []
        return model

    def is_serializable(self, safe_serialization: bool = True) -> bool:
        # Fp8Linear's buffers carry ModelOpt's tensor names and the config serializes as ModelOpt's.
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        # Fp8Linear's GEMMs are torch.library custom ops under torch.compile: no graph breaks.
        return True

    def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype


def _register() -> None:
    for method in REGISTERED_METHODS:
        if AUTO_QUANTIZER_MAPPING.get(method) is not Fp8RouteHfQuantizer:
            if method in AUTO_QUANTIZER_MAPPING:
                continue  # claimed by transformers itself: leave it (the config was not registered either)
            register_quantizer(method)(Fp8RouteHfQuantizer)


_register()
