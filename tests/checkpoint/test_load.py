"""Loading FP8 checkpoints written here by hand: layouts, fusion, KV scales, and every way a
checkpoint can be wrong, each named by tensor and file."""

import json
import os

import pytest
import torch
from checkpoint_helpers import (
    LINEARS,
    TINY,
    ct_config,
    ct_folder,
    fp8_linear_tensors,
    fp8_llama,
    llama_tensors,
    modelopt_folder,
    write_checkpoint,
)
from safetensors.torch import save_file

from fp8route import CheckpointError, Fp8Linear, load_checkpoint
from fp8route.quant import FP8_DTYPE, dequantize

L0 = "model.layers.0"
# Projections that read the same input were calibrated on it: they share an input scale.


def test_modelopt_loads_and_fuses_qkv_and_gate_up(tmp_path):
    tensors = fp8_llama()
    tensors[f"{L0}.self_attn.v_proj.input_scale"] = torch.tensor(3.5 / 448)
    ckpt = load_checkpoint(modelopt_folder(tmp_path, tensors), device="cpu")
    assert ckpt.format == "modelopt" and ckpt.config["hidden_size"] == 64
    assert list(ckpt.linears) == [
        f"model.layers.{i}.{m}"
        for i in (0, 1)
        for m in ("mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj", "self_attn.qkv_proj")
    ]
    qkv = ckpt.linears[f"{L0}.self_attn.qkv_proj"]
    assert isinstance(qkv, Fp8Linear) and qkv.logical_widths == (64, 32, 32) and qkv.weight.dtype == FP8_DTYPE
    assert qkv.input_scale.item() == pytest.approx(3.5 / 448)  # the max of q, k, v's input scales
    assert ckpt.linears[f"{L0}.mlp.gate_up_proj"].logical_widths == (160, 160)
    assert qkv.requant_error > 0 and ckpt.linears[f"{L0}.self_attn.o_proj"].requant_error == 0
    assert ckpt.fused[f"{L0}.self_attn.qkv_proj"] == tuple(
        f"{L0}.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj")
    )
    assert ckpt.excluded == ("lm_head",) and ckpt.tensors["lm_head.weight"].dtype == torch.bfloat16
    assert set(ckpt.tensors) == {
        n for n in llama_tensors() if n.removesuffix(".weight").rpartition(".")[2] not in LINEARS
    }
    assert ckpt.kv_scales == {}


def test_fused_equals_unfused_within_reported_requant_error(tmp_path):
    folder = modelopt_folder(tmp_path)
    fused = load_checkpoint(folder, device="cpu")
    apart = load_checkpoint(folder, device="cpu", fuse=False)
    assert f"{L0}.self_attn.q_proj" in apart.linears and not apart.fused
    for name, layer in fused.linears.items():
        x = torch.randn(16, layer.in_features)
        if name not in fused.fused:
            assert torch.equal(layer(x), apart.linears[name](x))
            continue
        parts = [apart.linears[m] for m in fused.fused[name]]
        original = torch.cat([dequantize(p.weight, p.weight_scale) for p in parts])
        fused_w = dequantize(layer.weight, layer.weight_scale)
        assert ((fused_w - original).norm() / original.norm()).item() == pytest.approx(layer.requant_error, rel=1e-5)
        # Same input scale (q/k/v share their input), so outputs differ only by the requantization.
        unfused = torch.cat([p(x) for p in parts], dim=-1)
        rel = ((layer(x) - unfused).norm() / unfused.norm()).item()
        assert rel <= 2 * layer.requant_error + 1e-6


def test_compressed_tensors_scales_of_shape_one_in_bf16_become_fp32(tmp_path):
    tensors = fp8_llama(scale_shape=(1,), scale_dtype=torch.bfloat16)
    tensors[f"{L0}.self_attn.o_proj.weight_zero_point"] = torch.zeros(1, dtype=FP8_DTYPE)
    ckpt = load_checkpoint(ct_folder(tmp_path, tensors), device="cpu")
    layer = ckpt.linears[f"{L0}.self_attn.o_proj"]
    assert layer.weight_scale.shape == () and layer.weight_scale.dtype == torch.float32
    assert layer.weight_scale.item() == tensors[f"{L0}.self_attn.o_proj.weight_scale"].float().item()
    assert ckpt.format == "compressed-tensors" and f"{L0}.self_attn.o_proj.weight_zero_point" not in ckpt.tensors


def test_sharded_with_index_loads_the_same(tmp_path):
    single = load_checkpoint(modelopt_folder(tmp_path / "a"), device="cpu")
    sharded = load_checkpoint(modelopt_folder(tmp_path / "b", shards=3), device="cpu")
    assert list(single.linears) == list(sharded.linears)
    for name, layer in single.linears.items():
        assert torch.equal(layer.weight.view(torch.uint8), sharded.linears[name].weight.view(torch.uint8))


def test_kv_scales_are_exposed_under_the_attention_module(tmp_path):
    tensors = fp8_llama()
    tensors[f"{L0}.self_attn.k_proj.k_scale"] = torch.tensor(0.5)  # ModelOpt puts them on k_proj / v_proj
    tensors[f"{L0}.self_attn.v_proj.v_scale"] = torch.tensor(0.25, dtype=torch.bfloat16)
    tensors["model.layers.1.self_attn.k_scale"] = torch.tensor([0.125])  # compressed-tensors on the attention
    ckpt = load_checkpoint(modelopt_folder(tmp_path, tensors), device="cpu")
    assert {k: v.item() for k, v in ckpt.kv_scales.items()} == {
        f"{L0}.self_attn.k_scale": 0.5,
        f"{L0}.self_attn.v_scale": 0.25,
        "model.layers.1.self_attn.k_scale": 0.125,
    }
    assert all(v.dtype == torch.float32 and v.shape == () for v in ckpt.kv_scales.values())


def test_qkv_biases_are_fused_with_the_weights(tmp_path):
    tensors = fp8_llama(bias=True)
    ckpt = load_checkpoint(modelopt_folder(tmp_path, tensors), device="cpu")
    bias = ckpt.linears[f"{L0}.self_attn.qkv_proj"].bias
    expected = torch.cat([tensors[f"{L0}.self_attn.{m}.bias"] for m in ("q_proj", "k_proj", "v_proj")])
    assert bias is not None and torch.equal(bias, expected)


def test_slices_read_parts_fused_to_the_whole_layers_scales(tmp_path):
    folder = modelopt_folder(tmp_path, fp8_llama(bias=True))
    whole = load_checkpoint(folder, device="cpu")
    attn = f"{L0}.self_attn"
    slices = {
        f"{attn}.{m}.{part}": (slice(8, 16),) for m in ("q_proj", "k_proj", "v_proj") for part in ("weight", "bias")
    }
    slices[f"{attn}.o_proj.weight"] = (slice(None), slice(16, 48))
    part = load_checkpoint(folder, device="cpu", slices=slices)
    qkv, ref = part.linears[f"{attn}.qkv_proj"], whole.linears[f"{attn}.qkv_proj"]
    rows = torch.cat([torch.arange(8, 16) + start for start in (0, 64, 96)])  # q 64 rows, k and v 32 each
    assert qkv.logical_widths == (8, 8, 8)
    # The whole q/k/v's per-tensor scales, so the requantized values are the whole layer's rows.
    assert torch.equal(qkv.weight_scale, ref.weight_scale) and torch.equal(qkv.input_scale, ref.input_scale)
    assert torch.equal(qkv.weight.view(torch.uint8), ref.weight[rows].view(torch.uint8))
    assert qkv.bias is not None and ref.bias is not None and torch.equal(qkv.bias, ref.bias[rows])
    o, ref_o = part.linears[f"{attn}.o_proj"], whole.linears[f"{attn}.o_proj"]
    assert torch.equal(o.weight.view(torch.uint8), ref_o.weight[:, 16:48].view(torch.uint8))
    assert part.linears["model.layers.1.self_attn.qkv_proj"].weight.shape == (128, 64)


def test_slices_outside_a_tensor_are_refused(tmp_path):
    folder = modelopt_folder(tmp_path)
    with pytest.raises(CheckpointError, match=r"q_proj.weight in model.safetensors has shape \[64, 64\]: no \[32:96\]"):
        load_checkpoint(folder, device="cpu", slices={f"{L0}.self_attn.q_proj.weight": (slice(32, 96),)})


def test_partially_quantized_projections_are_not_fused(tmp_path):
    tensors = fp8_llama()
    for leaf in ("weight_scale", "input_scale"):
        del tensors[f"{L0}.self_attn.v_proj.{leaf}"]
    tensors[f"{L0}.self_attn.v_proj.weight"] = llama_tensors()[f"{L0}.self_attn.v_proj.weight"]
    hf_quant = {"quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head", f"{L0}.self_attn.v_proj"]}}
    folder = write_checkpoint(tmp_path / "ckpt", tensors, TINY, **{"hf_quant_config.json": hf_quant})
    ckpt = load_checkpoint(folder, device="cpu")
    assert f"{L0}.self_attn.q_proj" in ckpt.linears and f"{L0}.self_attn.qkv_proj" not in ckpt.linears
    assert f"{L0}.self_attn.v_proj" in ckpt.excluded


# Every way a checkpoint can be wrong: each error names the tensor (or shard) and the file.


def test_only_safetensors_are_read_never_pickles(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY, "quantization_config": ct_config()}))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(
        CheckpointError, match=r"no \*\.safetensors files \(pytorch_model\.bin are pickles, which fp8route never loads"
    ):
        load_checkpoint(folder, device="cpu")


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/outside.safetensors", "sub/model.safetensors"])
def test_index_naming_shards_outside_the_folder_is_rejected(tmp_path, shard):
    folder = modelopt_folder(tmp_path)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "outside.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": shard}}))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        load_checkpoint(folder, device="cpu")


def test_shard_symlinked_outside_the_folder_is_rejected(tmp_path):
    folder = modelopt_folder(tmp_path)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "outside.safetensors"))
    os.symlink(tmp_path / "outside.safetensors", folder / "extra.safetensors")
    with pytest.raises(CheckpointError, match="extra.safetensors .* links to .*outside the checkpoint folder"):
        load_checkpoint(folder, device="cpu")


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_truncated_or_corrupt_safetensors(tmp_path, damage):
    folder = modelopt_folder(tmp_path, shards=2)
    shard = folder / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100] if damage == "truncate" else data[:9] + b"\x00" + data[10:])
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors .*not a valid safetensors file"):
        load_checkpoint(folder, device="cpu")


@pytest.mark.parametrize("leaf", ["weight_scale", "input_scale"])
def test_missing_scale(tmp_path, leaf):
    tensors = fp8_llama()
    del tensors[f"{L0}.mlp.down_proj.{leaf}"]
    with pytest.raises(
        CheckpointError,
        match=rf"missing {L0}\.mlp\.down_proj\.{leaf}: {L0}\.mlp\.down_proj\.weight in model\.safetensors",
    ):
        load_checkpoint(modelopt_folder(tmp_path, tensors), device="cpu")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -0.5])
@pytest.mark.parametrize("leaf", ["weight_scale", "input_scale"])
def test_bad_scale_values(tmp_path, value, leaf):
    tensors = fp8_llama()
    tensors[f"{L0}.self_attn.k_proj.{leaf}"] = torch.tensor(value)
    with pytest.raises(
        CheckpointError, match=rf"{L0}\.self_attn\.k_proj\.{leaf} in model\.safetensors: a scale must be finite and > 0"
    ):
        load_checkpoint(modelopt_folder(tmp_path, tensors), device="cpu")


def test_weight_not_fp8(tmp_path):
    tensors = fp8_llama()
    tensors[f"{L0}.mlp.up_proj.weight"] = llama_tensors()[f"{L0}.mlp.up_proj.weight"]
    with pytest.raises(
        CheckpointError,
        match=rf"{L0}\.mlp\.up_proj\.weight in model\.safetensors: expected dtype float8_e4m3fn .*got bfloat16",
    ):
        load_checkpoint(modelopt_folder(tmp_path, tensors), device="cpu")


@pytest.mark.parametrize(
    ("tensor", "value", "match"),
    [
        (
            "mlp.up_proj.weight_scale",
            torch.ones(160, 1),
            r"has shape \[160, 1\] but quantization\.quant_algo=FP8 in hf_quant_config\.json \(per-tensor scales, "
            r"static input scale\) expects \[\] or \[1\]: one value",
        ),
        ("mlp.up_proj.input_scale", torch.ones(4), r"has shape \[4\]; expected one per-tensor scale of shape \[\] or"),
        (
            "mlp.up_proj.weight",
            torch.zeros(160 * 64).to(FP8_DTYPE),
            r"expected a 2-D \[N, K\] weight, got shape \[10240\]",
        ),
        ("self_attn.q_proj.bias", torch.zeros(63, dtype=torch.bfloat16), r"expected a float bias of shape \[64\]"),
        (
            "self_attn.q_proj.weight_scale",
            torch.tensor(1, dtype=torch.int32),
            "expected a float32/bfloat16/float16 scale, got int32",
        ),
    ],
)
def test_shape_and_dtype_mismatches(tmp_path, tensor, value, match):
    tensors = fp8_llama()
    tensors[f"{L0}.{tensor}"] = value
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint(modelopt_folder(tmp_path, tensors), device="cpu")
    assert f"{L0}.{tensor} in model.safetensors" in str(info.value)


def test_same_tensor_in_two_shards(tmp_path):
    folder = modelopt_folder(tmp_path)
    save_file({"model.norm.weight": torch.ones(64)}, str(folder / "extra.safetensors"))
    with pytest.raises(
        CheckpointError, match="tensor model.norm.weight is in two shards: extra.safetensors and model.safetensors"
    ):
        load_checkpoint(folder, device="cpu")


def test_index_that_disagrees_with_the_shards(tmp_path):
    folder = modelopt_folder(tmp_path, shards=2)
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    actual = index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.norm.weight"] = shards[1 - shards.index(actual)]
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"tensor model\.norm\.weight is in {actual} but .* names model-"):
        load_checkpoint(folder, device="cpu")
    index["weight_map"]["model.norm.weight"] = actual
    index["weight_map"]["model.ghost.weight"] = actual
    path.write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=f"lists 1 tensor.* absent from their shards, e.g. model.ghost.weight in {actual}"
    ):
        load_checkpoint(folder, device="cpu")


def test_config_says_fp8_but_tensors_are_bf16(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt", llama_tensors(), {**TINY, "quantization_config": ct_config()})
    with pytest.raises(
        CheckpointError,
        match=rf"config.json says FP8 \(compressed-tensors\) but {L0}\.mlp\.down_proj\.weight in model\.safetensors "
        "is bfloat16",
    ):
        load_checkpoint(folder, device="cpu")


def test_no_fp8_tensor_at_all(tmp_path):
    tensors = {"model.embed_tokens.weight": torch.zeros(8, 4), "model.norm.weight": torch.ones(4)}
    with pytest.raises(CheckpointError, match="says FP8 .* but no tensor .* is float8_e4m3fn"):
        load_checkpoint(ct_folder(tmp_path, tensors), device="cpu")


def test_nan_in_fp8_weight(tmp_path):
    tensors = fp8_llama()
    w = tensors[f"{L0}.mlp.gate_proj.weight"].clone()
    w.view(torch.uint8)[3, 5] = 0x7F
    tensors[f"{L0}.mlp.gate_proj.weight"] = w
    with pytest.raises(CheckpointError, match=rf"{L0}\.mlp\.gate_proj\.weight in model\.safetensors: 1 NaN value"):
        load_checkpoint(modelopt_folder(tmp_path, tensors), device="cpu")


def test_excluded_module_with_fp8_weight(tmp_path):
    tensors = {**fp8_llama(), **fp8_linear_tensors("lm_head", 256, 64)}
    with pytest.raises(
        CheckpointError,
        match="lm_head.weight in model.safetensors is float8_e4m3fn but hf_quant_config.json excludes lm_head",
    ):
        load_checkpoint(modelopt_folder(tmp_path, tensors), device="cpu")


@pytest.mark.parametrize("leaf", ["weight_scale_2", "weight_packed", "input_global_scale"])
def test_tensors_of_other_schemes(tmp_path, leaf):
    tensors = fp8_llama()
    tensors[f"{L0}.mlp.down_proj_extra.{leaf}"] = torch.ones(1)
    with pytest.raises(
        CheckpointError, match=rf"unsupported: tensor {L0}\.mlp\.down_proj_extra\.{leaf} in model\.safetensors"
    ):
        load_checkpoint(modelopt_folder(tmp_path, tensors), device="cpu")


def test_nonzero_zero_point(tmp_path):
    tensors = fp8_llama(scale_shape=(1,))
    tensors[f"{L0}.self_attn.o_proj.input_zero_point"] = torch.ones(1)
    with pytest.raises(
        CheckpointError, match=rf"unsupported: {L0}\.self_attn\.o_proj\.input_zero_point in model\.safetensors"
    ):
        load_checkpoint(ct_folder(tmp_path, tensors), device="cpu")
