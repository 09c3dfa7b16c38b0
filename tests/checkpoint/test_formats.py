"""Quantization configs: what each format accepts, what it rejects, and how exclusions match."""

import copy
import re

import pytest
from checkpoint_helpers import MODELOPT_HF_QUANT, ct_config

from fp8route import CheckpointError
from fp8route.checkpoint.formats import QuantScheme, compressed_tensors, detect_scheme, modelopt


def test_modelopt_hf_quant_config():
    scheme = modelopt.parse_hf_quant_config(
        {
            "producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]},
        }
    )
    assert scheme == QuantScheme("modelopt", "hf_quant_config.json", ("lm_head",), "FP8")


def test_modelopt_config_json_flat_and_nested():
    flat = modelopt.parse_config_json(
        {
            "quant_method": "modelopt",
            "quant_algo": "fp8",
            "ignore": ["lm_head", "model.layers.*.mlp*"],
            "kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": False, "strategy": "tensor"},
        }
    )
    assert flat.exclude == ("lm_head", "model.layers.*.mlp*") and flat.kv_cache == "FP8"
    nested = modelopt.parse_config_json({"quant_method": "modelopt", **MODELOPT_HF_QUANT})
    assert nested.exclude == ("lm_head",) and nested.kv_cache is None


@pytest.mark.parametrize(
    ("quantization", "field", "value"),
    [
        ({"quant_algo": "NVFP4"}, "quantization.quant_algo", "NVFP4"),
        ({"quant_algo": "FP8_PB_WO"}, "quantization.quant_algo", "FP8_PB_WO"),
        ({"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}, "quantization.quant_algo", "FP8_PER_CHANNEL_PER_TOKEN"),
        ({"quant_algo": "W4A16_AWQ"}, "quantization.quant_algo", "W4A16_AWQ"),
        ({"quant_algo": None}, "quantization.quant_algo", "None"),
        ({"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"}, "quantization.kv_cache_quant_algo", "NVFP4"),
        ({"quant_algo": "FP8", "pre_quant_scale": True}, "quantization.pre_quant_scale", "True"),
    ],
)
def test_modelopt_rejects_other_schemes(quantization, field, value):
    with pytest.raises(CheckpointError, match=f"^unsupported: {field}={value} in hf_quant_config.json"):
        modelopt.parse_hf_quant_config({"quantization": quantization})


def test_compressed_tensors_static_per_tensor():
    scheme = compressed_tensors.parse(ct_config(["lm_head", "re:.*mlp.gate$"]))
    assert scheme.format == "compressed-tensors" and scheme.kv_cache is None
    assert scheme.exclude == ("lm_head", "re:.*mlp.gate$")
    naive = ct_config()
    naive["format"] = "naive-quantized"
    naive["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    assert compressed_tensors.parse(naive).kv_cache == "FP8"


def _ct(path: str, value: object) -> dict:
    config = copy.deepcopy(ct_config())
    *parents, leaf = path.split(".")
    node = config
    for key in parents:
        node = node[key]
    node[leaf] = value
    return config


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("format", "pack-quantized"),
        ("format", "nvfp4-pack-quantized"),
        ("config_groups.group_0.weights.strategy", "channel"),
        ("config_groups.group_0.weights.strategy", "block"),
        ("config_groups.group_0.weights.block_structure", [128, 128]),
        ("config_groups.group_0.weights.num_bits", 4),
        ("config_groups.group_0.weights.type", "int"),
        ("config_groups.group_0.input_activations.strategy", "token"),
        ("config_groups.group_0.input_activations.dynamic", True),
        ("config_groups.group_0.input_activations", None),
        ("config_groups.group_0.weights.symmetric", False),
        ("config_groups.group_0.output_activations", {"num_bits": 8}),
        ("sparsity_config", {"format": "sparse-24-bitmask"}),
    ],
)
def test_compressed_tensors_rejects_other_schemes(path, value):
    expected = f"unsupported: quantization_config.{path}={value} in config.json"
    with pytest.raises(CheckpointError, match="^" + re.escape(expected)):
        compressed_tensors.parse(_ct(path, value))


def test_detect_reads_both_modelopt_files_and_merges_exclusions(tmp_path):
    (tmp_path / "hf_quant_config.json").write_text(
        '{"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}}'
    )
    config = {
        "quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["model.layers.0.mlp*"]}
    }
    scheme = detect_scheme(tmp_path, config)
    assert scheme.format == "modelopt" and scheme.kv_cache == "FP8"
    assert set(scheme.exclude) == {"lm_head", "model.layers.0.mlp*"}
    assert "hf_quant_config.json" in scheme.source and "config.json" in scheme.source


def test_detect_rejects_conflicts_unknown_methods_and_plain_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="unsupported: quantization_config.quant_method=fp8 in config.json"):
        detect_scheme(tmp_path, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    with pytest.raises(CheckpointError, match="no quantization config"):
        detect_scheme(tmp_path, {"hidden_size": 64})
    (tmp_path / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "FP8"}}')
    with pytest.raises(CheckpointError, match="says compressed-tensors but hf_quant_config.json says modelopt"):
        detect_scheme(tmp_path, {"quantization_config": ct_config()})


@pytest.mark.parametrize(
    ("pattern", "module", "excluded"),
    [
        ("lm_head", "lm_head", True),
        ("lm_head", "model.lm_head_extra", False),
        ("model.layers.*.mlp*", "model.layers.3.mlp", True),
        ("model.layers.*.mlp*", "model.layers.3.mlp.down_proj", True),
        ("model.layers.*.mlp*", "model.layers.3.self_attn.q_proj", False),
        ("model.layers.1.mlp", "model.layers.1.mlp.up_proj", True),
        ("model.layers.1.mlp", "model.layers.11.mlp.up_proj", False),
        ("re:.*mlp.gate$", "model.layers.0.mlp.gate", True),
        ("re:.*mlp.gate$", "model.layers.0.mlp.gate_proj", False),
    ],
)
def test_exclusion_matching(pattern, module, excluded):
    assert QuantScheme("modelopt", "x", (pattern,)).excludes(module) is excluded


def test_written_configs_are_accepted_by_our_reader():
    qc, hf_quant = modelopt.config_files(["lm_head"], {"name": "fp8route"})
    assert modelopt.parse_config_json(qc).exclude == ("lm_head",)
    assert modelopt.parse_hf_quant_config(hf_quant).exclude == ("lm_head",)
    assert compressed_tensors.parse(compressed_tensors.quantization_config(["lm_head"])).exclude == ("lm_head",)
