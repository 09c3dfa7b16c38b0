"""fp8route.hf.from_pretrained and the registered quantizer: transformers models with Fp8Linear layers."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_helpers import BLOCKY, TINY, hub_snapshot
from hf_helpers import FORMATS, float_checkpoint, modelopt_config_json
from transformers import AutoModelForCausalLM, PreTrainedModel

import fp8route
import fp8route.hf
from fp8route.checkpoint.random import write_random
from fp8route.engine import load_model
from fp8route.errors import CheckpointError

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IDS = torch.tensor([[1, 17, 200, 45, 3, 99, 128, 7, 64, 250]])


def fp8_module_names(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, fp8route.Fp8Linear)]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_from_pretrained_matches_fp8routes_own_runner(tmp_path, fmt):
    folder = FORMATS[fmt](tmp_path)
    model = fp8route.hf.from_pretrained(folder, dtype=torch.float32)
    assert isinstance(model, PreTrainedModel)
    expected = [f"model.layers.{i}.{p}.{m}" for i in range(2) for p, m in
                [("self_attn", m) if m in PROJECTIONS[:4] else ("mlp", m) for m in PROJECTIONS]]  # fmt: skip
    assert sorted(fp8_module_names(model)) == sorted(expected)
    assert type(model.lm_head) is torch.nn.Linear  # excluded by the checkpoint: stays float
    assert model.model.embed_tokens.weight.dtype == torch.float32
    with torch.no_grad():
        ours = model(IDS).logits
    reference = load_model(folder, device="cpu", dtype=torch.float32)(IDS)
    torch.testing.assert_close(ours, reference, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize(("scheme", "config"), [("channel", TINY), ("block", BLOCKY)])
def test_from_pretrained_runs_channel_and_block_checkpoints(tmp_path, scheme, config):
    folder = write_random(tmp_path / scheme, config, fp8=True, device="cpu", scheme=scheme)
    model = fp8route.hf.from_pretrained(folder, dtype=torch.float32)
    layers = [m for m in model.modules() if isinstance(m, fp8route.Fp8Linear)]
    assert len(layers) == 14 and all(layer.scheme == scheme for layer in layers)
    with torch.no_grad():
        ours = model(IDS % config["vocab_size"]).logits
    reference = load_model(folder, device="cpu", dtype=torch.float32)(IDS % config["vocab_size"])
    torch.testing.assert_close(ours, reference, atol=2e-4, rtol=1e-4)


def test_fp8_layers_are_readable_and_explained(tmp_path):
    model = fp8route.hf.from_pretrained(FORMATS["modelopt"](tmp_path), dtype=torch.float32)
    text = repr(model)
    assert "(q_proj): Fp8Linear(in_features=64, out_features=64, bias=False, scheme=tensor, input_scale=static)" in text
    assert "(lm_head): Linear(in_features=64, out_features=256" in text
    report = fp8route.explain(model)
    # Every layer appears in explain: listed by name, or counted under the first of its plan group.
    listed = sum(1 + int(line.split("(+")[1].split()[0]) if "(+" in line else 1
                 for line in report.splitlines() if line.startswith("model.layers."))  # fmt: skip
    assert listed == len(fp8_module_names(model)) == 14


def test_automodel_loads_a_modelopt_checkpoint_through_fp8route(tmp_path):
    assert "modelopt" in fp8route.hf.REGISTERED_METHODS
    folder = modelopt_config_json(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert len(fp8_module_names(model)) == 14
    assert isinstance(model.config.quantization_config, fp8route.hf.Fp8RouteConfig)
    direct = fp8route.hf.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, direct(IDS).logits)


def test_explicit_config_selects_fp8route_for_modelopt(tmp_path):
    folder = FORMATS["modelopt-legacy"](tmp_path)  # no quantization_config in config.json for transformers to see
    config = fp8route.hf.Fp8RouteConfig()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, quantization_config=config)
    assert len(fp8_module_names(model)) == 14
    assert model.config.quantization_config.exclude == ["lm_head"]


def test_a_float_folder_is_one_clear_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="this is not an FP8 checkpoint"):
        fp8route.hf.from_pretrained(float_checkpoint(tmp_path))


def test_a_missing_folder_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="expected a checkpoint folder"):
        fp8route.hf.from_pretrained(tmp_path / "nowhere")


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_a_config_that_contradicts_the_tensors_is_refused_before_transformers_runs(tmp_path, fmt):
    folder = FORMATS[fmt](tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    message = "config.json has num_hidden_layers=1, but the checkpoint holds layer 1 too"
    with pytest.raises(CheckpointError, match=f"^{message}"):
        fp8route.hf.from_pretrained(folder)
    if fmt == "modelopt":  # the registered quantizer checks it too
        with pytest.raises(CheckpointError, match=f"^{message}"):
            AutoModelForCausalLM.from_pretrained(folder)


def test_a_repository_id_in_the_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    folder = FORMATS["modelopt"](tmp_path)
    expected = fp8route.hf.from_pretrained(folder, dtype=torch.float32)(IDS).logits
    hub_snapshot(tmp_path / "hub", "acme/tiny-fp8", folder)
    with torch.no_grad():
        logits = fp8route.hf.from_pretrained("acme/tiny-fp8", dtype=torch.float32)(IDS).logits
    torch.testing.assert_close(logits, expected)
    with pytest.raises(CheckpointError, match="^acme/elsewhere is neither a local folder nor in the Hugging Face"):
        fp8route.hf.from_pretrained("acme/elsewhere")


def test_other_quantization_configs_are_refused(tmp_path):
    from transformers import FineGrainedFP8Config

    with pytest.raises(fp8route.Fp8InputError, match="Fp8RouteConfig"):
        fp8route.hf.from_pretrained(FORMATS["modelopt"](tmp_path), quantization_config=FineGrainedFP8Config())


def test_config_round_trips_as_modelopt():
    config = fp8route.hf.Fp8RouteConfig(exclude=["lm_head", "model.layers.0.mlp.down_proj"])
    data = config.to_dict()
    assert data["quant_method"] == "modelopt" and data["quant_algo"] == "FP8"
    assert data["ignore"] == ["lm_head", "model.layers.0.mlp.down_proj"]
    again = fp8route.hf.Fp8RouteConfig.from_dict(data)
    assert again.quant_method == "modelopt" and again.exclude == config.exclude


def test_a_modelopt_checkpoint_fp8route_cannot_run_is_refused_by_automodel(tmp_path):
    # Without fp8route.hf, transformers 5.x skips an unknown "modelopt" quantization_config and
    # loads the FP8 bytes into float linears; with it, the checkpoint is refused with the reason.
    folder = FORMATS["modelopt"](tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["quant_algo"] = "NVFP4"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quant_algo=NVFP4"):
        AutoModelForCausalLM.from_pretrained(folder)
