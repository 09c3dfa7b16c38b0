"""Quantization configs: what each format accepts, what it rejects, and how exclusions match."""

import copy
import re

import pytest
from checkpoint_helpers import MODELOPT_HF_QUANT, ct_config

from fp8route import CheckpointError
from fp8route.checkpoint.formats import QuantScheme, compressed_tensors, detect_scheme, fp8, modelopt


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
        ({"quant_algo": "W4A16_NVFP4"}, "quantization.quant_algo", "W4A16_NVFP4"),
        ({"quant_algo": "MXFP8"}, "quantization.quant_algo", "MXFP8"),
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
        ("config_groups.group_0.weights.strategy", "group"),
        ("config_groups.group_0.weights.strategy", "tensor_group"),
        ("config_groups.group_0.weights.block_structure", [128, 128]),
        ("config_groups.group_0.weights.num_bits", 4),
        ("config_groups.group_0.weights.type", "int"),
        ("config_groups.group_0.weights.dynamic", True),
        ("config_groups.group_0.weights.actorder", "group"),
        ("config_groups.group_0.input_activations.strategy", "token"),
        ("config_groups.group_0.input_activations.dynamic", "local"),
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


def _ct_scheme(scheme: str, **changes: object) -> dict:
    """A compressed-tensors config of llm-compressor's FP8_DYNAMIC (channel) or FP8_BLOCK (block),
    with the changes given as dotted paths under config_groups.group_0 ("weights.strategy")."""
    config = copy.deepcopy(compressed_tensors.quantization_config(["lm_head"], scheme=scheme))
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = config["config_groups"]["group_0"]
        for key in parents:
            node = node[key]
        node[leaf] = value
    return config


@pytest.mark.parametrize(
    ("scheme", "origin"),
    [("channel", "weights.strategy=channel"), ("block", "weights.strategy=block")],
)
def test_compressed_tensors_dynamic_schemes(scheme, origin):
    parsed = compressed_tensors.parse(_ct_scheme(scheme))
    assert (parsed.fp8_scheme, parsed.static_input, parsed.scale_name) == (scheme, False, "weight_scale")
    assert parsed.origin == f"quantization_config.config_groups.group_0.{origin} in config.json"
    dynamic_tensor = _ct("config_groups.group_0.input_activations.dynamic", True)
    parsed = compressed_tensors.parse(dynamic_tensor)
    assert (parsed.fp8_scheme, parsed.static_input) == ("tensor", False)


@pytest.mark.parametrize(
    ("scheme", "path", "value", "why"),
    [
        (
            "channel",
            "input_activations.strategy",
            "tensor",
            "channel weights run with input_activations strategy token",
        ),
        ("channel", "input_activations.dynamic", False, "channel weights run with input_activations strategy token"),
        ("channel", "weights.group_size", 128, ""),
        ("block", "weights.block_structure", [64, 64], ""),
        ("block", "input_activations.group_size", 64, ""),
        ("block", "input_activations.strategy", "token", "block weights run with input_activations strategy group"),
        ("block", "input_activations.dynamic", False, "block weights run with input_activations strategy group"),
    ],
)
def test_compressed_tensors_refuses_other_pairings(scheme, path, value, why):
    expected = f"unsupported: quantization_config.config_groups.group_0.{path}={value} in config.json; {why}"
    with pytest.raises(CheckpointError, match="^" + re.escape(expected)):
        compressed_tensors.parse(_ct_scheme(scheme, **{path: value}))


def test_compressed_tensors_refuses_two_schemes_in_one_checkpoint():
    config = _ct_scheme("channel")
    config["config_groups"]["group_1"] = _ct_scheme("block")["config_groups"]["group_0"]
    with pytest.raises(
        CheckpointError,
        match=r"^config\.json: quantization_config\.config_groups\.group_0 is per-channel weight scales, dynamic "
        r"per-token input but quantization_config\.config_groups\.group_1 is 128x128 block weight scales, .*one FP8 "
        "scheme per checkpoint",
    ):
        compressed_tensors.parse(config)
    config["config_groups"]["group_1"] = _ct_scheme("channel")["config_groups"]["group_0"]
    assert compressed_tensors.parse(config).fp8_scheme == "channel"


@pytest.mark.parametrize(
    ("algo", "scheme"),
    [("FP8", "tensor"), ("FP8_PER_CHANNEL_PER_TOKEN", "channel"), ("fp8_pb_wo", "block")],
)
def test_modelopt_fp8_algorithms(algo, scheme):
    parsed = modelopt.parse_hf_quant_config({"quantization": {"quant_algo": algo}})
    assert (parsed.fp8_scheme, parsed.static_input) == (scheme, scheme == "tensor")
    assert parsed.origin == f"quantization.quant_algo={algo} in hf_quant_config.json"


QWEN3_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def test_quant_method_fp8_block_and_per_tensor():
    block = fp8.parse(QWEN3_FP8)
    assert (block.format, block.fp8_scheme, block.static_input, block.scale_name) == (
        "fp8",
        "block",
        False,
        "weight_scale_inv",
    )
    assert block.exclude == ("lm_head",) and block.origin == (
        "quantization_config.weight_block_size=[128, 128] in config.json"
    )
    both = fp8.parse({**QWEN3_FP8, "ignored_layers": ["model.layers.0.mlp"], "modules_to_not_convert": ["lm_head"]})
    assert both.exclude == ("model.layers.0.mlp", "lm_head")
    static = fp8.parse({"quant_method": "fp8", "activation_scheme": "static"})
    assert (static.fp8_scheme, static.static_input, static.scale_name) == ("tensor", True, "weight_scale")
    dynamic = fp8.parse({"quant_method": "fp8", "activation_scheme": "dynamic"})
    assert (dynamic.fp8_scheme, dynamic.static_input) == ("tensor", False)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"weight_block_size": [128]}, r"^quantization_config\.weight_block_size=\[128\] in config\.json is malformed"),
        (
            {"weight_block_size": [128, 0]},
            r"^quantization_config\.weight_block_size=\[128, 0\] in config\.json is malformed",
        ),
        ({"weight_block_size": "128x128"}, r"^quantization_config\.weight_block_size='128x128' in config\.json is mal"),
        ({"weight_block_size": [True, 128]}, r"malformed: expected two positive integers"),
        (
            {"weight_block_size": [64, 64]},
            r"^unsupported: quantization_config\.weight_block_size=\[64, 64\] in config\.json; fp8route serves "
            "128x128 blocks only",
        ),
        ({"activation_scheme": "static"}, r"^unsupported: quantization_config\.activation_scheme=static in config"),
        ({"activation_scheme": None}, r"^unsupported: quantization_config\.activation_scheme=None in config\.json"),
        ({"fmt": "e5m2"}, r"^unsupported: quantization_config\.fmt=e5m2 in config\.json"),
        ({"modules_to_not_convert": "lm_head"}, r"modules_to_not_convert must be a list of module names"),
    ],
)
def test_quant_method_fp8_refusals(change, match):
    with pytest.raises(CheckpointError, match=match):
        fp8.parse({**QWEN3_FP8, **change})


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
    with pytest.raises(CheckpointError, match="unsupported: quantization_config.quant_method=gptq in config.json"):
        detect_scheme(tmp_path, {"quantization_config": {"quant_method": "gptq", "bits": 4}})
    assert detect_scheme(tmp_path, {"quantization_config": QWEN3_FP8}).fp8_scheme == "block"
    with pytest.raises(CheckpointError, match="no quantization config"):
        detect_scheme(tmp_path, {"hidden_size": 64})
    (tmp_path / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "FP8"}}')
    with pytest.raises(CheckpointError, match="says compressed-tensors but hf_quant_config.json says modelopt"):
        detect_scheme(tmp_path, {"quantization_config": ct_config()})
    channel = {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}
    with pytest.raises(
        CheckpointError,
        match=r"quantization_config\.quant_algo=FP8_PER_CHANNEL_PER_TOKEN in config\.json says per-channel weight "
        r"scales, dynamic per-token input but quantization\.quant_algo=FP8 in hf_quant_config\.json says per-tensor",
    ):
        detect_scheme(tmp_path, {"quantization_config": channel})


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


@pytest.mark.parametrize("scheme", ["tensor", "channel"])
def test_written_modelopt_configs_are_accepted_by_our_reader(scheme):
    qc, hf_quant = modelopt.config_files(["lm_head"], {"name": "fp8route"}, scheme=scheme)
    for parsed in (modelopt.parse_config_json(qc), modelopt.parse_hf_quant_config(hf_quant)):
        assert parsed.exclude == ("lm_head",) and parsed.fp8_scheme == scheme


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_written_compressed_tensors_configs_are_accepted_by_our_reader(scheme):
    parsed = compressed_tensors.parse(compressed_tensors.quantization_config(["lm_head"], scheme=scheme))
    assert parsed.exclude == ("lm_head",) and parsed.fp8_scheme == scheme


def test_written_fp8_config_is_accepted_by_our_reader():
    parsed = fp8.parse(fp8.quantization_config(["lm_head", "model.layers.1.mlp.down_proj"]))
    assert parsed.fp8_scheme == "block" and parsed.exclude == ("lm_head", "model.layers.1.mlp.down_proj")
