"""quantize_model + save_pretrained: a float transformers model -> a ModelOpt FP8 checkpoint every loader takes."""

from __future__ import annotations

import json

import pytest
import torch
from hf_helpers import float_checkpoint
from transformers import AutoModelForCausalLM

import fp8route
import fp8route.hf
from fp8route.engine import load_model
from fp8route.quant import FP8_MAX

IDS = torch.tensor([[1, 17, 200, 45, 3, 99, 128, 7]])


@pytest.fixture
def float_model(tmp_path):
    return AutoModelForCausalLM.from_pretrained(float_checkpoint(tmp_path), dtype=torch.float32)


def calibration() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def observed_amax(model: torch.nn.Module, name: str, calib: torch.Tensor) -> float:
    seen: list[float] = []
    handle = model.get_submodule(name).register_forward_pre_hook(lambda _, a: seen.append(a[0].abs().max().item()))
    with torch.no_grad():
        model(calib, use_cache=False)
    handle.remove()
    return max(seen)


def test_quantize_model_calibrates_static_scales_and_keeps_lm_head_float(float_model):
    calib = calibration()
    amax = observed_amax(float_model, "model.layers.1.mlp.down_proj", calib)
    with torch.no_grad():
        before = float_model(IDS).logits
    fp8route.hf.quantize_model(float_model, calib)
    fp8 = {n: m for n, m in float_model.named_modules() if isinstance(m, fp8route.Fp8Linear)}
    assert len(fp8) == 14 and type(float_model.lm_head) is torch.nn.Linear
    down = fp8["model.layers.1.mlp.down_proj"]
    assert down.input_scale is not None and down.input_scale.item() == pytest.approx(amax / FP8_MAX, rel=1e-6)
    with torch.no_grad():
        after = float_model(IDS).logits
    assert torch.nn.functional.cosine_similarity(after.flatten(), before.flatten(), dim=0) > 0.995
    assert float_model.config.quantization_config.exclude == ["lm_head"]


def test_exclude_patterns_keep_modules_float(float_model):
    fp8route.hf.quantize_model(float_model, [torch.arange(10), torch.arange(5, 30)], exclude=("lm_head", "*.mlp.*"))
    assert sum(isinstance(m, fp8route.Fp8Linear) for m in float_model.modules()) == 8
    assert type(float_model.model.layers[0].mlp.down_proj) is torch.nn.Linear


def test_bad_calibration_is_an_input_error(float_model):
    with pytest.raises(fp8route.Fp8InputError, match="calib"):
        fp8route.hf.quantize_model(float_model, torch.zeros(2, 3, 4, dtype=torch.int64))
    with pytest.raises(fp8route.Fp8InputError, match="no nn.Linear left"):
        fp8route.hf.quantize_model(float_model, calibration(), exclude=("*",))


def test_save_pretrained_round_trips_through_every_loader(float_model, tmp_path):
    fp8route.hf.quantize_model(float_model, calibration())
    with torch.no_grad():
        quantized = float_model(IDS).logits
    folder = fp8route.hf.save_pretrained(float_model, tmp_path / "fp8")
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    assert config["quantization_config"]["ignore"] == ["lm_head"]
    hf_quant = json.loads((folder / "hf_quant_config.json").read_text())
    assert hf_quant["quantization"] == {
        "quant_algo": "FP8",
        "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head"],
    }

    checkpoint = fp8route.load_checkpoint(folder, "cpu", fuse=False)
    assert checkpoint.format == "modelopt" and len(checkpoint.linears) == 14
    q = checkpoint.linears["model.layers.0.self_attn.q_proj"]
    mine = float_model.model.layers[0].self_attn.q_proj
    assert torch.equal(q.weight.view(torch.uint8), mine.weight.view(torch.uint8))
    assert q.weight_scale.item() == mine.weight_scale.item() and q.input_scale.item() == mine.input_scale.item()

    reloaded = fp8route.hf.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(IDS).logits, quantized, atol=0, rtol=0)
    # Our runner fuses q/k/v and gate/up, requantizing shards to the largest weight scale: close, not equal.
    ours = load_model(folder, device="cpu", dtype=torch.float32)(IDS)
    torch.testing.assert_close(ours, quantized, atol=0.1, rtol=0.05)


def test_the_models_own_save_pretrained_writes_a_modelopt_checkpoint(float_model, tmp_path):
    fp8route.hf.quantize_model(float_model, calibration())
    with torch.no_grad():
        quantized = float_model(IDS).logits
    float_model.save_pretrained(tmp_path / "native")
    assert fp8route.load_checkpoint(tmp_path / "native", "cpu").format == "modelopt"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "native", dtype=torch.float32)
    assert isinstance(reloaded.model.layers[1].mlp.up_proj, fp8route.Fp8Linear)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(IDS).logits, quantized, atol=0, rtol=0)


def test_save_pretrained_needs_fp8_layers(float_model, tmp_path):
    with pytest.raises(fp8route.Fp8InputError, match="quantize_model"):
        fp8route.hf.save_pretrained(float_model, tmp_path / "out")


def test_save_pretrained_fails_cleanly(float_model, tmp_path, monkeypatch):
    from fp8route.checkpoint import destination, shards

    fp8route.hf.quantize_model(float_model, calibration())
    folder = tmp_path / "fp8"
    with pytest.raises(fp8route.Fp8InputError, match="max_shard_bytes must be a positive number of bytes, got -1"):
        fp8route.hf.save_pretrained(float_model, folder, max_shard_bytes=-1)
    usage = destination.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(destination.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(
        fp8route.Fp8InputError, match=rf"save_pretrained: {folder}: the checkpoint needs about 0\.\d MB"
    ):
        fp8route.hf.save_pretrained(float_model, folder)
    monkeypatch.undo()

    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")  # saved by the user first: a failed save keeps it

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device", "shard")

    monkeypatch.setattr(shards, "save_file", full_disk)
    with pytest.raises(fp8route.CheckpointError, match=f"cannot write {folder}: No space left on device"):
        fp8route.hf.save_pretrained(float_model, folder)
    assert [p.name for p in folder.iterdir()] == ["tokenizer.json"]
