"""bf16 checkpoint -> `quantize` -> `load_checkpoint`, for both formats, checked against the original."""

import json

import pytest
import torch
from checkpoint_helpers import TINY, llama_tensors, write_checkpoint

from fp8route import CheckpointError, Fp8InputError, load_checkpoint, quantize_checkpoint, sqnr_db
from fp8route.checkpoint import quantize as quantize_module
from fp8route.checkpoint.calibration import generated_token_ids, load_token_ids
from fp8route.checkpoint.formats import compressed_tensors, modelopt
from fp8route.checkpoint.shards import ShardSet
from fp8route.cli import main
from fp8route.loading import model_from_checkpoint
from fp8route.models import LlamaConfig, LlamaForCausalLM
from fp8route.models.llama import FloatLinear

FORMATS = ["modelopt", "compressed-tensors"]
CALIB = generated_token_ids(TINY["vocab_size"], sequences=3, length=48, seed=1)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("bf16") / "src", llama_tensors(), TINY, shards=2)


@pytest.fixture(scope="module", params=FORMATS)
def quantized(request, source, tmp_path_factory):
    dst = tmp_path_factory.mktemp("fp8") / request.param
    report = quantize_checkpoint(source, dst, format=request.param, calib=CALIB, device="cpu")
    return report, dst


def linear_inputs(model: LlamaForCausalLM, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each full-precision linear's input while the model runs on ids."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        module.register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, args[0].detach()))
        for name, module in model.named_modules()
        if isinstance(module, FloatLinear)
    ]
    with torch.no_grad():
        model(ids, dtype=torch.float32)
    for hook in hooks:
        hook.remove()
    return seen


def test_every_linear_is_quantized_but_lm_head(quantized):
    report, dst = quantized
    ckpt = load_checkpoint(dst, device="cpu", fuse=False)
    expected = [
        f"model.layers.{i}.{g}.{m}"
        for i in (0, 1)
        for g, ms in (
            ("mlp", ("down_proj", "gate_proj", "up_proj")),
            ("self_attn", ("k_proj", "o_proj", "q_proj", "v_proj")),
        )
        for m in ms
    ]
    assert sorted(report.quantized) == sorted(expected) == sorted(ckpt.linears)
    assert report.excluded == ["lm_head"] and ckpt.excluded == ("lm_head",)
    assert ckpt.format == report.format and ckpt.scheme.exclude == ("lm_head",)
    assert report.calibration_tokens == 3 * 48


def test_each_linear_matches_the_bf16_original(quantized):
    """SQNR of every FP8 linear against its bf16 weights, on the activations it really sees."""
    _, dst = quantized
    tensors = llama_tensors()
    ckpt = load_checkpoint(dst, device="cpu", fuse=False)
    inputs = linear_inputs(LlamaForCausalLM(LlamaConfig.from_hf(TINY), {}, tensors), torch.stack(CALIB))
    for name, layer in ckpt.linears.items():
        x = inputs[name]
        expected = x @ tensors[f"{name}.weight"].float().t()
        assert sqnr_db(expected, layer(x)) >= 25, name


def test_fused_model_matches_unfused_and_bf16(quantized):
    _, dst = quantized
    cfg = LlamaConfig.from_hf(TINY)
    ids = torch.stack(generated_token_ids(TINY["vocab_size"], sequences=2, length=32, seed=7))
    fused_ckpt = load_checkpoint(dst, device="cpu")
    with torch.no_grad():
        reference = LlamaForCausalLM(cfg, {}, llama_tensors())(ids, dtype=torch.float32)
        fused = model_from_checkpoint(fused_ckpt)(ids, dtype=torch.float32)
        unfused = model_from_checkpoint(load_checkpoint(dst, device="cpu", fuse=False))(ids, dtype=torch.float32)
    worst = max(layer.requant_error for layer in fused_ckpt.linears.values())
    assert 0 < worst < 0.05
    # Four layers' requantization errors add up, each amplified a little by what follows it.
    assert ((fused - unfused).norm() / unfused.norm()).item() <= 4 * worst
    assert sqnr_db(reference, unfused) >= 25 and sqnr_db(reference, fused) >= 25


def test_written_files_follow_the_formats_conventions(quantized, source):
    report, dst = quantized
    config = json.loads((dst / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == TINY
    qc = config["quantization_config"]
    shards = ShardSet.open(dst)
    scale = shards.tensors["model.layers.0.mlp.down_proj.weight_scale"]
    assert shards.tensors["model.layers.0.mlp.down_proj.weight"].dtype == "F8_E4M3" and scale.dtype == "F32"
    if report.format == "modelopt":
        assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "FP8" and qc["ignore"] == ["lm_head"]
        hf_quant = json.loads((dst / modelopt.HF_QUANT_CONFIG).read_text())
        assert hf_quant["quantization"] == {
            "quant_algo": "FP8",
            "kv_cache_quant_algo": None,
            "exclude_modules": ["lm_head"],
        }
        assert scale.shape == ()
    else:
        # The calibration record is the one key added to the standard config.
        assert {k: v for k, v in qc.items() if k != "fp8route"} == compressed_tensors.quantization_config(["lm_head"])
        assert not (dst / modelopt.HF_QUANT_CONFIG).exists()
        assert scale.shape == (1,)


def test_exclusion_patterns_and_quantized_lm_head(source, tmp_path):
    report = quantize_checkpoint(
        source, tmp_path / "q", format="modelopt", calib=CALIB, exclude=["model.layers.1.mlp*"]
    )
    assert "lm_head" in report.quantized
    assert sorted(report.excluded) == [f"model.layers.1.mlp.{m}" for m in ("down_proj", "gate_proj", "up_proj")]
    ckpt = load_checkpoint(tmp_path / "q", device="cpu")
    assert "lm_head" in ckpt.linears and "model.layers.1.mlp.gate_up_proj" not in ckpt.linears
    assert ckpt.tensors["model.layers.1.mlp.up_proj.weight"].dtype == torch.bfloat16


def test_small_shards_get_an_index(source, tmp_path):
    report = quantize_checkpoint(
        source, tmp_path / "q", format="compressed-tensors", calib=CALIB, max_shard_bytes=40_000
    )
    assert len(report.shards) > 2 and (tmp_path / "q" / "model.safetensors.index.json").exists()
    assert len(load_checkpoint(tmp_path / "q", device="cpu").linears) == 8


def test_tied_embeddings_keep_lm_head_out_of_quantization(tmp_path):
    config = {**TINY, "tie_word_embeddings": True}
    src = write_checkpoint(tmp_path / "src", llama_tensors(config), config)
    report = quantize_checkpoint(src, tmp_path / "q", format="compressed-tensors", calib=CALIB)
    assert report.excluded == ["lm_head"]
    ckpt = load_checkpoint(tmp_path / "q", device="cpu")
    assert "lm_head.weight" not in ckpt.tensors and ckpt.scheme.exclude == ("lm_head",)
    logits = model_from_checkpoint(ckpt)(torch.stack(CALIB[:1]), dtype=torch.float32)
    assert logits.shape == (1, 48, TINY["vocab_size"])


def test_bad_sources_and_destinations(source, tmp_path, quantized):
    _, fp8_dst = quantized
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(fp8_dst, tmp_path / "again", calib=CALIB)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(Fp8InputError, match="exists and is not empty"):
        quantize_checkpoint(source, tmp_path / "busy", calib=CALIB)
    with pytest.raises(Fp8InputError, match="format must be one of"):
        quantize_checkpoint(source, tmp_path / "x", format="gptq")


@pytest.mark.parametrize("suffix", [".json", ".txt"])
def test_calibration_files(tmp_path, suffix):
    path = tmp_path / f"calib{suffix}"
    rows = [[1, 2, 3], [4, 5]]
    path.write_text(json.dumps(rows) if suffix == ".json" else "1 2 3\n4,5\n")
    assert [t.tolist() for t in load_token_ids(path, 10)] == rows
    path.write_text(json.dumps([[1, 99]]) if suffix == ".json" else "1 99\n")
    with pytest.raises(Fp8InputError, match="token id 99, outside the vocabulary"):
        load_token_ids(path, 10)


def test_cli_quantize_then_inspect(source, tmp_path, capsys):
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps([t.tolist() for t in CALIB]))
    dst = tmp_path / "cli"
    assert main(["quantize", str(source), str(dst), "--format", "modelopt", "--calib", str(calib)]) == 0
    out, err = capsys.readouterr()
    assert "14 FP8 linears, 1 excluded (lm_head)" in out and "quantize [" in err and "3/3" in err
    assert main(["inspect", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "format: modelopt (from config.json + hf_quant_config.json)" in out
    assert "FP8 linears: 8 layers from 14 checkpoint linears (fused: 2 gate_up_proj, 2 qkv_proj)" in out
    assert "fusion requantization error" in out and "input_scale" in out and "weight_scale" in out
    assert "shapes failing a backend's gate" in out and "plans on this device (cpu)" in out
    assert main(["inspect", str(source)]) == 2
    assert "no quantization config" in capsys.readouterr().err


def test_inspect_lists_shapes_that_fail_a_gate(tmp_path, capsys):
    config = {**TINY, "intermediate_size": 72}  # down_proj K=72: not a multiple of 16
    src = write_checkpoint(tmp_path / "src", llama_tensors(config), config)
    quantize_checkpoint(src, tmp_path / "q", format="compressed-tensors", calib=CALIB)
    assert main(["inspect", str(tmp_path / "q"), "--no-fuse"]) == 0
    out = capsys.readouterr().out
    assert (
        "N=64 K=72 (model.layers.0.mlp.down_proj, model.layers.1.mlp.down_proj): cublas: K=72 is not a multiple of 16"
        in out
    )
    assert "N=72 K=64 (model.layers.0.mlp.gate_proj" in out and "N=72 is not a multiple of 16" in out
    assert "N=64 K=64" not in out.split("plans on this device")[0]


def test_a_missing_weight_is_refused_before_anything_is_written(tmp_path):
    tensors = llama_tensors()
    del tensors["model.layers.1.mlp.down_proj.weight"]
    src = write_checkpoint(tmp_path / "src", tensors, TINY)
    with pytest.raises(CheckpointError, match=r"^model\.layers\.1\.mlp\.down_proj\.weight is in no shard"):
        quantize_checkpoint(src, tmp_path / "out" / "fp8", format="modelopt", device="cpu")
    assert not (tmp_path / "out").exists()


def test_a_failure_midway_leaves_no_output(tmp_path, monkeypatch):
    # A failure after shards were written (here, quantizing layer 1's first linear) must not leave
    # the half-written folder behind.
    real, calls = quantize_module.quantize_per_tensor, []

    def fails_in_layer_1(weight: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(weight.shape)
        if len(calls) > 7:
            raise CheckpointError("made to fail in layer 1")
        return real(weight, **kwargs)

    monkeypatch.setattr(quantize_module, "quantize_per_tensor", fails_in_layer_1)
    src = write_checkpoint(tmp_path / "src", llama_tensors(), TINY)
    with pytest.raises(CheckpointError, match="made to fail in layer 1"):
        quantize_checkpoint(src, tmp_path / "out" / "fp8", format="modelopt", device="cpu", max_shard_bytes=4096)
    assert len(calls) == 8
    assert list((tmp_path / "out").iterdir()) == []


def test_a_nan_in_the_source_names_the_tensor_and_leaves_no_output(tmp_path):
    tensors = llama_tensors()
    tensors["model.layers.1.mlp.up_proj.weight"][3, 3] = float("inf")
    src = write_checkpoint(tmp_path / "src", tensors, TINY)
    with pytest.raises(
        Fp8InputError,
        match=r"^model\.layers\.1\.mlp\.up_proj\.weight in model\.safetensors: 1 NaN or Inf value\(s\); expected",
    ):
        quantize_checkpoint(src, tmp_path / "out" / "fp8", format="modelopt", calib=CALIB, device="cpu")
    assert list((tmp_path / "out").iterdir()) == []
