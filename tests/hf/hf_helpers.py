"""What the transformers tests share: the skip (or, under CI, the failure) without transformers,
and tiny Llama checkpoints transformers' LlamaConfig accepts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if os.environ.get("CI"):
    import transformers  # noqa: F401  (CI must install the extra: a missing transformers fails here)
else:
    pytest.importorskip(
        "transformers",
        reason="transformers is not installed (pip install 'fp8route[transformers]'); under CI this fails instead",
    )

from checkpoint_helpers import MODELOPT_HF_QUANT, TINY, ct_config, llama_tensors, write_checkpoint  # noqa: E402

from fp8route.checkpoint.formats import modelopt  # noqa: E402
from fp8route.quant import FP8_MAX, quantize_per_tensor  # noqa: E402

HF_TINY = {**TINY, "head_dim": 16, "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2}
# Modules that our runner fuses (q/k/v, gate/up) share one weight and one input scale here, so the
# fused layer needs no requantization and both runners compute the same products.
_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",))
_INPUT_AMAX = {"q_proj": 3.0, "gate_proj": 4.0, "o_proj": 1.5, "down_proj": 6.0}


def shared_scale_fp8_llama(config: dict = HF_TINY, scale_shape: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    tensors = llama_tensors(config)
    out = {n: t for n, t in tensors.items() if not any(n.endswith(f".{m}.weight") for g in _GROUPS for m in g)}
    for layer in range(config["num_hidden_layers"]):
        for group in _GROUPS:
            parent = "self_attn" if group[0] in ("q_proj", "o_proj") else "mlp"
            names = [f"model.layers.{layer}.{parent}.{m}" for m in group]
            amax = max(tensors[f"{n}.weight"].float().abs().max() for n in names)
            scale = amax / FP8_MAX
            for n in names:
                out[f"{n}.weight"], _ = quantize_per_tensor(tensors[f"{n}.weight"].float(), scale)
                out[f"{n}.weight_scale"] = scale.reshape(scale_shape).float().clone()
                out[f"{n}.input_scale"] = torch.tensor(_INPUT_AMAX[group[0]] / FP8_MAX).reshape(scale_shape)
    return out


def modelopt_legacy(tmp_path: Path) -> Path:
    """ModelOpt with hf_quant_config.json only (config.json has no quantization_config)."""
    return write_checkpoint(tmp_path / "modelopt-legacy", shared_scale_fp8_llama(), HF_TINY,
                            **{modelopt.HF_QUANT_CONFIG: MODELOPT_HF_QUANT})  # fmt: skip


def modelopt_config_json(tmp_path: Path) -> Path:
    """ModelOpt with config.json's quantization_config (quant_method "modelopt") only."""
    qc, _ = modelopt.config_files(["lm_head"], {"name": "modelopt", "version": "0.29.0"})
    return write_checkpoint(tmp_path / "modelopt", shared_scale_fp8_llama(), {**HF_TINY, "quantization_config": qc})


def compressed_tensors(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "ct", shared_scale_fp8_llama(scale_shape=(1,)),
                            {**HF_TINY, "quantization_config": ct_config()})  # fmt: skip


def float_checkpoint(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "float", llama_tensors(HF_TINY), HF_TINY)


FORMATS = {
    "modelopt-legacy": modelopt_legacy,
    "modelopt": modelopt_config_json,
    "compressed-tensors": compressed_tensors,
}
