"""`quantize --scheme channel|block` in every format that writes them: read back tensor for tensor,
the configs holding the keys the real loaders read (vLLM's, and the formats' own), and the options
and format pairs that mean nothing for a scheme refused before anything is written."""

import json
import re

import pytest
import torch
from checkpoint_helpers import BLOCKY, TINY, llama_tensors, write_checkpoint
from safetensors.torch import load_file

from fp8route import Fp8InputError, load_checkpoint, quantize_checkpoint, sqnr_db
from fp8route.checkpoint.formats import NOT_WRITTEN, modelopt
from fp8route.checkpoint.shards import ShardSet
from fp8route.cli import main
from fp8route.schemes import quantize_weight

WRITTEN = [
    ("channel", "compressed-tensors"),
    ("channel", "modelopt"),
    ("block", "fp8"),
    ("block", "compressed-tensors"),
]
# The keys each real loader reads (vLLM main, 2026): Fp8Config.from_config; CompressedTensorsConfig.from_config
# and its _quantization_scheme_map_from_config; ModelOptQuantConfigBase.from_config (both forms). Beside them,
# the keys the formats' own libraries define: transformers' FineGrainedFP8Config, compressed-tensors'
# QuantizationConfig / QuantizationScheme / QuantizationArgs, ModelOpt's producer (which vLLM reads to
# recognize a ModelOpt folder). "fp8route" is our calibration record, which all of them ignore.
VLLM_FP8 = {"quant_method", "activation_scheme", "ignored_layers", "weight_block_size", "modules_to_not_convert"}
TRANSFORMERS_FP8 = {"quant_method", "activation_scheme", "weight_block_size", "modules_to_not_convert", "dequantize",
                    "scale_fmt"}  # fmt: skip
FP8_CONVENTION = {"fmt"}  # DeepSeek-V3's and Qwen3's configs carry it; no loader reads it
VLLM_CT = {
    "quant_method",
    "format",
    "config_groups",
    "ignore",
    "kv_cache_scheme",
    "sparsity_config",
    "transform_config",
}
CT_OWN = {"quantization_status", "global_compression_ratio"}
VLLM_CT_GROUP = {"targets", "weights", "input_activations", "format"}
CT_GROUP = {"output_activations"}
# QuantizationArgs' fields but scale_dtype and zp_dtype, which older vLLM's QuantizationArgs (extra="forbid") refuse.
CT_ARGS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
           "observer", "observer_kwargs"}  # fmt: skip
VLLM_MODELOPT = {"quant_method", "quant_algo", "kv_cache_scheme", "ignore", "group_size"}
VLLM_MODELOPT_QUANTIZATION = {"quant_algo", "kv_cache_quant_algo", "exclude_modules", "group_size"}
RECORD = {"fp8route"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    return {
        "channel": write_checkpoint(root / "tiny", llama_tensors(TINY), TINY, shards=2),
        "block": write_checkpoint(root / "blocky", llama_tensors(BLOCKY), BLOCKY),
    }


@pytest.fixture(scope="module", params=WRITTEN, ids=[f"{s}-{f}" for s, f in WRITTEN])
def written(request, sources, tmp_path_factory):
    scheme, format = request.param
    dst = tmp_path_factory.mktemp("fp8") / f"{scheme}-{format}"
    report = quantize_checkpoint(sources[scheme], dst, format=format, scheme=scheme, device="cpu")
    return scheme, format, report, dst


def stored(folder):
    return {name: t for file in ShardSet.open(folder).files for name, t in load_file(str(folder / file)).items()}


def test_every_tensor_loads_back_as_written(written, sources):
    scheme, format, report, dst = written
    assert (report.scheme, report.format) == (scheme, format)
    files, source = stored(dst), stored(sources[scheme])
    ckpt = load_checkpoint(dst, device="cpu", fuse=False)
    assert ckpt.fp8_scheme == scheme and ckpt.format == format and sorted(ckpt.linears) == sorted(report.quantized)
    scale_name = "weight_scale_inv" if format == "fp8" else "weight_scale"
    assert not any(n.endswith("input_scale") for n in files)
    for name, layer in ckpt.linears.items():
        assert torch.equal(layer.weight.view(torch.uint8), files[f"{name}.weight"].view(torch.uint8)), name
        scale = files[f"{name}.{scale_name}"]
        assert torch.equal(layer.weight_scale, scale.float().reshape(layer.weight_scale.shape)), name
        assert layer.scheme == scheme and layer.input_scale is None
        original = source[f"{name}.weight"].float()
        x = torch.randn(16, layer.in_features)
        assert sqnr_db(x @ original.t(), layer(x)) >= 25, name
    for name, tensor in ckpt.tensors.items():
        assert torch.equal(tensor, source[name]), name


def test_scales_are_stored_as_each_formats_tools_store_them(written, sources):
    scheme, format, _, dst = written
    files, source = stored(dst), stored(sources[scheme])
    down = "model.layers.0.mlp.down_proj"
    n, k = source[f"{down}.weight"].shape
    expected = {
        ("channel", "compressed-tensors"): ("weight_scale", (n, 1), torch.bfloat16),  # FP8_DYNAMIC: the model's dtype
        ("channel", "modelopt"): ("weight_scale", (n,), torch.float32),  # FP8_PER_CHANNEL_PER_TOKEN
        ("block", "fp8"): ("weight_scale_inv", (-(-n // 128), -(-k // 128)), torch.float32),
        ("block", "compressed-tensors"): ("weight_scale", (-(-n // 128), -(-k // 128)), torch.bfloat16),
    }[scheme, format]
    name, shape, dtype = expected
    scale = files[f"{down}.{name}"]
    assert (tuple(scale.shape), scale.dtype) == (shape, dtype)
    if dtype == torch.float32:  # the scales fp8route.schemes computes, and the e4m3 values made with them
        q, s = quantize_weight(source[f"{down}.weight"].float(), scheme)
        assert torch.equal(scale.reshape(s.shape), s) and torch.equal(
            files[f"{down}.weight"].view(torch.uint8), q.view(torch.uint8)
        )


def test_configs_hold_the_keys_the_real_loaders_read(written):
    scheme, format, _, dst = written
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    keys = set(qc) - RECORD
    if format == "fp8":
        assert (
            {"quant_method", "activation_scheme", "weight_block_size"}
            <= keys
            <= VLLM_FP8 | TRANSFORMERS_FP8 | FP8_CONVENTION
        )
        assert qc["weight_block_size"] == [128, 128] and qc["activation_scheme"] == "dynamic"
        assert qc["ignored_layers"] == qc["modules_to_not_convert"] == ["lm_head"]
    elif format == "compressed-tensors":
        assert {"quant_method", "format", "config_groups"} <= keys <= VLLM_CT | CT_OWN
        for group in qc["config_groups"].values():
            assert {"targets", "weights", "input_activations"} <= set(group) <= VLLM_CT_GROUP | CT_GROUP
            assert set(group["weights"]) <= CT_ARGS and set(group["input_activations"]) <= CT_ARGS
        weights, inputs = qc["config_groups"]["group_0"]["weights"], qc["config_groups"]["group_0"]["input_activations"]
        if scheme == "channel":  # llm-compressor's FP8_DYNAMIC preset
            assert (weights["strategy"], inputs["strategy"], inputs["dynamic"]) == ("channel", "token", True)
        else:  # FP8_BLOCK
            assert (weights["strategy"], weights["block_structure"]) == ("block", [128, 128])
            assert (inputs["strategy"], inputs["group_size"], inputs["dynamic"]) == ("group", 128, True)
    else:
        assert {"quant_method", "quant_algo"} <= keys <= VLLM_MODELOPT | {"producer"}
        hf_quant = json.loads((dst / modelopt.HF_QUANT_CONFIG).read_text())
        assert set(hf_quant) == {"producer", "quantization"}
        assert {"quant_algo"} <= set(hf_quant["quantization"]) <= VLLM_MODELOPT_QUANTIZATION
        assert qc["quant_algo"] == hf_quant["quantization"]["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN"


@pytest.mark.parametrize(("format", "scheme"), sorted(NOT_WRITTEN))
def test_pairs_not_written_are_refused_before_anything_is(sources, tmp_path, format, scheme):
    with pytest.raises(Fp8InputError, match=f"^format {format} with scheme {scheme} is not written: "):
        quantize_checkpoint(sources["channel"], tmp_path / "out", format=format, scheme=scheme)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("option", "named"),
    [
        ({"input_scale": "mse"}, "input_scale (--input-scale)"),
        ({"percentile": 99.0}, "percentile (--percentile)"),
        ({"keep_float": 2}, "keep_float (--keep-float)"),
        ({"kl_budget": 0.1}, "kl_budget (--kl-budget)"),
    ],
)
@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_input_calibration_options_are_refused_for_dynamic_schemes(sources, tmp_path, scheme, option, named):
    with pytest.raises(Fp8InputError, match="^" + re.escape(f"{named}: the {scheme} scheme ")):
        quantize_checkpoint(sources["channel"], tmp_path / "out", scheme=scheme, **option)
    with pytest.raises(Fp8InputError, match=r"^calibration data \(--calib / --calib-text\) with the .* --kv-cache fp8"):
        quantize_checkpoint(sources["channel"], tmp_path / "out", scheme=scheme, calib=[torch.tensor([1, 2, 3])])
    assert not (tmp_path / "out").exists()


def test_kv_cache_scales_are_calibrated_for_a_dynamic_scheme(sources, tmp_path):
    ids = [torch.arange(40) % TINY["vocab_size"], torch.arange(7, 47)]
    report = quantize_checkpoint(
        sources["channel"], tmp_path / "kv", scheme="channel", calib=ids, kv_cache="fp8", device="cpu"
    )
    assert len(report.kv_scales) == 2 * TINY["num_hidden_layers"] and report.calibration_tokens == 80
    ckpt = load_checkpoint(tmp_path / "kv", device="cpu")
    assert ckpt.scheme.kv_cache == "FP8" and set(ckpt.kv_scales) == {
        f"model.layers.{i}.self_attn.{kv}_scale" for i in (0, 1) for kv in "kv"
    }
    record = ckpt.config["quantization_config"]["fp8route"]
    assert record["scheme"] == "channel" and record["calibration"]["tokens"] == 80


def test_cli_quantize_block_then_inspect(sources, tmp_path, capsys):
    dst = tmp_path / "block"
    assert main(["quantize", str(sources["block"]), str(dst), "--scheme", "block", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {dst} (fp8, block scheme): 14 FP8 linears, 1 excluded (lm_head)" in out
    assert "calibration: no input scales (the block scheme quantizes each input at run time)" in out
    assert main(["inspect", str(dst), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "format: fp8 (from config.json); kv cache: none" in out
    assert (
        "scheme: block, 128x128 block weight scales, dynamic 1x128 input groups "
        "(quantization_config.weight_block_size=[128, 128] in config.json)" in out
    )
    # q/k/v fuse (256 + 128 + 128 rows); gate/up (320 rows) stay apart.
    assert "FP8 linears: 10 layers from 14 checkpoint linears (fused: 2 qkv_proj)" in out
    assert "fused layers: their members' block scales concatenated, nothing requantized" in out
    assert "over 60 scales" in out and "input_scale: none (each input is quantized at run time)" in out
    assert "N=512 K=256  cpu, 128x128 block weight scales, dynamic 1x128 input groups" in out
    assert "calibration: no input scales" in out
    assert main(["quantize", str(sources["block"]), str(tmp_path / "x"), "--scheme", "block", "--keep-float", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp8route quantize: keep_float (--keep-float): the block scheme quantizes each input")
    assert err.count("\n") == 1
