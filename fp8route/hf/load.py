"""fp8route.hf.from_pretrained: a transformers causal LM whose FP8 linears are Fp8Linear."""

from __future__ import annotations

import os
from typing import Any

from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from fp8route.checkpoint.config_check import check_config
from fp8route.checkpoint.formats import CONFIG, detect_scheme, read_json
from fp8route.checkpoint.hub import resolve_model_path
from fp8route.checkpoint.shards import ShardSet
from fp8route.errors import Fp8InputError
from fp8route.hf.config import Fp8RouteConfig


def from_pretrained(path: str | os.PathLike[str], **kwargs: Any) -> PreTrainedModel:
    """AutoModelForCausalLM.from_pretrained for a local ModelOpt, compressed-tensors or quant_method
    "fp8" FP8 folder of any scheme (per tensor, channel or block)
    (or a repository id already in the Hugging Face hub cache: fp8route.checkpoint.hub.resolve_model_path;
    never downloaded), every FP8 linear an fp8route.Fp8Linear (q/k/v and gate/up stay separate
    modules, as transformers has them) and every other tensor loaded by transformers.

    kwargs go to transformers (dtype, device_map, attn_implementation, ...). The checkpoint's
    own quantization_config is set aside and Fp8RouteConfig given instead, so this works for
    every format whatever quantizer transformers has registered for it. A folder that is not
    an FP8 checkpoint fp8route loads, or whose config.json contradicts its tensors' shapes, raises
    CheckpointError before transformers runs.
    """
    folder = resolve_model_path(path)
    config_json = read_json(folder / CONFIG)
    detect_scheme(folder, config_json)
    check_config(config_json, ShardSet.open(folder).tensors)
    given = kwargs.pop("quantization_config", None)
    if given is not None and not isinstance(given, Fp8RouteConfig):
        raise Fp8InputError(
            f"from_pretrained: quantization_config must be an fp8route.hf.Fp8RouteConfig (or left out), "
            f"got {type(given).__name__}"
        )
    if "config" in kwargs:
        config = kwargs.pop("config")
    else:
        config_kwargs = {k: kwargs[k] for k in ("trust_remote_code", "revision") if k in kwargs}
        config = AutoConfig.from_pretrained(folder, **config_kwargs)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    return AutoModelForCausalLM.from_pretrained(
        folder, config=config, quantization_config=given or Fp8RouteConfig(), **kwargs
    )
