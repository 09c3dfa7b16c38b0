"""Fp8RouteConfig: the transformers quantization config that selects fp8route's loader.

transformers picks a quantizer by the `quant_method` of a config's quantization_config. This
class is registered under "fp8route" (what `quantization_config=Fp8RouteConfig()` carries) and,
when no other library has claimed it, under "modelopt": transformers 5.x has no ModelOpt support
of its own, so a ModelOpt FP8 checkpoint (config.json quant_method "modelopt") then loads through
fp8route with a plain `AutoModelForCausalLM.from_pretrained(path)` once `fp8route.hf` is imported.

Serialized (config.json, model.save_pretrained), the config is ModelOpt's own config.json form,
so what transformers writes is a ModelOpt FP8 checkpoint that every reader of that format takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, register_quantization_config
from transformers.utils.quantization_config import QuantizationConfigMixin

from fp8route.checkpoint.formats import modelopt
from fp8route.version import __version__

QUANT_METHOD = "fp8route"
MODELOPT = modelopt.FORMAT
# Keys of ModelOpt's config.json form that the config reads back (the rest are kept as given).
_EXCLUDE_KEYS = ("ignore", "exclude_modules")


class Fp8RouteConfig(QuantizationConfigMixin):
    """Load (or save) static per-tensor FP8 linears as fp8route.Fp8Linear.

    exclude: module names (or fnmatch wildcards) left in float; filled in by the loader from the
    checkpoint and by quantize_model from what it kept in float, and written as ModelOpt's
    `ignore` list when the model is saved. Other keyword arguments (the rest of a checkpoint's
    quantization_config) are kept so that the config round-trips.
    """

    def __init__(self, exclude: Sequence[str] | None = None, **kwargs: Any) -> None:
        method = str(kwargs.pop("quant_method", QUANT_METHOD))
        # transformers types quant_method as its own enum; registered methods are plain strings.
        self.quant_method = method if method in (QUANT_METHOD, MODELOPT) else QUANT_METHOD  # type: ignore[assignment]
        found = exclude
        if found is None:
            quantization = kwargs.get("quantization")
            source = quantization if isinstance(quantization, dict) else kwargs
            found = next((source[k] for k in _EXCLUDE_KEYS if isinstance(source.get(k), list)), [])
        self.exclude = [str(p) for p in found]
        self.extra = {k: v for k, v in kwargs.items() if k not in (*_EXCLUDE_KEYS, "quantization")}

    def to_dict(self) -> dict[str, Any]:
        """ModelOpt's config.json quantization_config (fp8route's reader and ModelOpt's agree on it)."""
        producer = {"name": "fp8route", "version": __version__}
        qc, _ = modelopt.config_files(sorted(set(self.exclude)), producer)
        return qc

    def to_diff_dict(self) -> dict[str, Any]:
        return self.to_dict()

    def hf_quant_config(self) -> dict[str, Any]:
        """hf_quant_config.json, for engines that read ModelOpt's older file only."""
        producer = {"name": "fp8route", "version": __version__}
        return modelopt.config_files(sorted(set(self.exclude)), producer)[1]


def _register() -> tuple[str, ...]:
    """Register Fp8RouteConfig under "fp8route", and under "modelopt" unless it is taken."""
    claimed = []
    for method in (QUANT_METHOD, MODELOPT):
        if AUTO_QUANTIZATION_CONFIG_MAPPING.get(method) is Fp8RouteConfig:
            claimed.append(method)
        elif method not in AUTO_QUANTIZATION_CONFIG_MAPPING:
            register_quantization_config(method)(Fp8RouteConfig)
            claimed.append(method)
    return tuple(claimed)


REGISTERED_METHODS = _register()
