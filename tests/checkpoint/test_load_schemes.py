"""Per-channel and 128x128 block checkpoints in each format that writes them (compressed-tensors
FP8_DYNAMIC / FP8_BLOCK, quant_method fp8, ModelOpt FP8_PER_CHANNEL_PER_TOKEN / FP8_PB_WO), written
here by hand: loaded with their scales as stored, fused where blocks allow, and every disagreement
between config and tensors refused in one line, from the headers."""

import pytest
import torch
from checkpoint_helpers import BLOCKY, QWEN3_FP8, TINY, fp8_llama, scheme_llama, write_checkpoint

from fp8route import CheckpointError, load_checkpoint
from fp8route.checkpoint.formats import compressed_tensors
from fp8route.schemes import quantize_activation, scaled_matmul

L0 = "model.layers.0"
HF_QUANT = "hf_quant_config.json"


def ct_folder(tmp_path, scheme, tensors, config=TINY):
    qc = compressed_tensors.quantization_config(["lm_head"], scheme=scheme)
    return write_checkpoint(tmp_path / "ckpt", tensors, {**config, "quantization_config": qc})


def fp8_folder(tmp_path, tensors, config=BLOCKY, qc=QWEN3_FP8):
    return write_checkpoint(tmp_path / "ckpt", tensors, {**config, "quantization_config": qc})


def modelopt_folder(tmp_path, algo, tensors, config=TINY):
    hf_quant = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": algo, "exclude_modules": ["lm_head"]}}
    return write_checkpoint(tmp_path / "ckpt", tensors, config, **{HF_QUANT: hf_quant})


def check_layers(ckpt, tensors, scale_name):
    """Every layer holds its members' e4m3 weights and scales as stored, and computes the scheme's product."""
    scheme = ckpt.fp8_scheme
    for name, layer in ckpt.linears.items():
        members = ckpt.fused.get(name, (name,))
        assert layer.scheme == scheme and layer.input_scale is None
        weight = torch.cat([tensors[f"{m}.weight"] for m in members])
        assert torch.equal(layer.weight.view(torch.uint8), weight.view(torch.uint8))
        scales = [tensors[f"{m}.{scale_name}"].float() for m in members]
        stored = torch.cat([s.reshape(s.shape[0], -1) if scheme == "block" else s.reshape(-1) for s in scales])
        assert torch.equal(layer.weight_scale, stored.reshape(layer.weight_scale.shape)), name
        x = torch.randn(5, layer.in_features)
        expected = scaled_matmul(*quantize_activation(x, scheme), layer.weight, layer.weight_scale, scheme)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_compressed_tensors_fp8_dynamic_channel_scales_in_bf16(tmp_path):
    tensors = scheme_llama("channel", scale_dtype=torch.bfloat16)
    ckpt = load_checkpoint(ct_folder(tmp_path, "channel", tensors), device="cpu")
    assert ckpt.fp8_scheme == "channel" and ckpt.scheme.static_input is False
    assert set(ckpt.fused) == {
        f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.qkv_proj", "mlp.gate_up_proj")
    }
    assert ckpt.linears[f"{L0}.self_attn.qkv_proj"].logical_widths == (64, 32, 32)
    check_layers(ckpt, tensors, "weight_scale")


def test_quant_method_fp8_block_fuses_only_whole_blocks(tmp_path):
    tensors = scheme_llama("block", BLOCKY, scale_name="weight_scale_inv")
    ckpt = load_checkpoint(fp8_folder(tmp_path, tensors), device="cpu")
    assert ckpt.fp8_scheme == "block" and ckpt.format == "fp8" and ckpt.excluded == ("lm_head",)
    # q/k/v (256, 128, 128 rows) fuse; gate/up (320 rows each, 2.5 blocks) stay apart.
    assert set(ckpt.fused) == {f"model.layers.{i}.self_attn.qkv_proj" for i in (0, 1)}
    assert f"{L0}.mlp.gate_proj" in ckpt.linears and f"{L0}.mlp.up_proj" in ckpt.linears
    assert ckpt.linears[f"{L0}.mlp.down_proj"].weight_scale.shape == (2, 3)  # K=320: a partial last block
    check_layers(ckpt, tensors, "weight_scale_inv")


def test_compressed_tensors_fp8_block_and_unfused_equal_fused(tmp_path):
    tensors = scheme_llama("block", BLOCKY)
    folder = ct_folder(tmp_path, "block", tensors, BLOCKY)
    fused, apart = load_checkpoint(folder, device="cpu"), load_checkpoint(folder, device="cpu", fuse=False)
    check_layers(fused, tensors, "weight_scale")
    qkv = fused.linears[f"{L0}.self_attn.qkv_proj"]
    x = torch.randn(3, qkv.in_features)
    parts = [apart.linears[f"{L0}.self_attn.{m}"](x) for m in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(qkv(x), torch.cat(parts, dim=-1))  # concatenated scales: no requantization


@pytest.mark.parametrize(
    ("algo", "scheme", "config", "shape"),
    [
        ("FP8_PER_CHANNEL_PER_TOKEN", "channel", TINY, lambda s: s),
        ("FP8_PB_WO", "block", BLOCKY, lambda s: s[:, None, :, None]),
    ],
)
def test_modelopt_channel_and_block(tmp_path, algo, scheme, config, shape):
    tensors = scheme_llama(scheme, config, scale_shape=shape)
    ckpt = load_checkpoint(modelopt_folder(tmp_path, algo, tensors, config), device="cpu")
    assert ckpt.fp8_scheme == scheme and ckpt.format == "modelopt"
    check_layers(ckpt, tensors, "weight_scale")


def test_quant_method_fp8_per_tensor_dynamic_and_static(tmp_path):
    static = fp8_llama()
    ckpt = load_checkpoint(
        fp8_folder(tmp_path / "s", static, TINY, {"quant_method": "fp8", "activation_scheme": "static"}),
        device="cpu",
    )
    assert ckpt.fp8_scheme == "tensor" and ckpt.linears[f"{L0}.mlp.down_proj"].input_scale is not None
    dynamic = {n: t for n, t in static.items() if not n.endswith("input_scale")}
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    ckpt = load_checkpoint(fp8_folder(tmp_path / "d", dynamic, TINY, qc), device="cpu")
    assert all(layer.input_scale is None for layer in ckpt.linears.values())
    assert ckpt.linears[f"{L0}.self_attn.qkv_proj"].requant_error > 0  # per-tensor shards still requantize


@pytest.mark.parametrize(
    ("tensor", "value", "message"),
    [
        (
            "mlp.down_proj.weight_scale",
            torch.ones(1, 3),
            f"{L0}.mlp.down_proj.weight_scale in model.safetensors has shape [1, 3] but quantization_config."
            "config_groups.group_0.weights.strategy=block in config.json (128x128 block weight scales, dynamic "
            "1x128 input groups) expects [2, 3]: one per 128x128 block of the [256, 320] weight, partial edge "
            "blocks included",
        ),
        (
            "mlp.down_proj.weight_scale",
            torch.ones(()),
            f"{L0}.mlp.down_proj.weight_scale in model.safetensors has shape [] but quantization_config."
            "config_groups.group_0.weights.strategy=block in config.json",
        ),
        (
            "mlp.down_proj.weight_scale_inv",
            torch.ones(2, 3),
            f"{L0}.mlp.down_proj.weight_scale_inv in model.safetensors: quantization_config.config_groups.group_0."
            "weights.strategy=block in config.json (128x128 block weight scales, dynamic 1x128 input groups) names "
            "each linear's weight scale weight_scale, not weight_scale_inv (weight_scale_inv is the block scale "
            "of quant_method fp8 checkpoints with weight_block_size)",
        ),
        (
            "self_attn.o_proj.input_scale",
            torch.tensor(0.01),
            f"{L0}.self_attn.o_proj.input_scale in model.safetensors is a static input scale but quantization_config"
            ".config_groups.group_0.weights.strategy=block in config.json says 128x128 block weight scales, dynamic "
            "1x128 input groups: x is quantized at run time, so the tensor would go unused; remove it",
        ),
        (
            "self_attn.o_proj.weight_scale",
            torch.tensor([[1.0, float("nan")], [0.0, 1.0]]),
            f"{L0}.self_attn.o_proj.weight_scale in model.safetensors: 2 scale(s) not finite and > 0",
        ),
    ],
)
def test_block_checkpoint_refusals(tmp_path, tensor, value, message):
    tensors = scheme_llama("block", BLOCKY)
    tensors[f"{L0}.{tensor}"] = value
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ct_folder(tmp_path, "block", tensors, BLOCKY), device="cpu")
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda t: t.__setitem__(f"{L0}.mlp.up_proj.weight_scale", torch.ones(1)),
            f"{L0}.mlp.up_proj.weight_scale in model.safetensors has shape [1] but quantization_config.config_groups"
            ".group_0.weights.strategy=channel in config.json (per-channel weight scales, dynamic per-token input) "
            "expects [160] or [160, 1]: one per output row of the [160, 64] weight",
        ),
        (
            lambda t: t.__setitem__(f"{L0}.mlp.up_proj.weight_scale", torch.ones(2, 80)),
            f"{L0}.mlp.up_proj.weight_scale in model.safetensors has shape [2, 80] but",
        ),
        (
            lambda t: t.pop(f"{L0}.mlp.up_proj.weight_scale"),
            f"missing {L0}.mlp.up_proj.weight_scale: {L0}.mlp.up_proj.weight in model.safetensors is FP8 but has no "
            "weight_scale in any shard (quantization_config.config_groups.group_0.weights.strategy=channel in config",
        ),
    ],
)
def test_channel_checkpoint_refusals(tmp_path, change, message):
    tensors = scheme_llama("channel")
    change(tensors)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ct_folder(tmp_path, "channel", tensors), device="cpu")
    assert str(info.value).startswith(message)


def test_quant_method_fp8_names_its_scales_weight_scale_inv(tmp_path):
    tensors = scheme_llama("block", BLOCKY)  # weight_scale, as compressed-tensors names it
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(fp8_folder(tmp_path, tensors), device="cpu")
    assert str(info.value).startswith(
        f"{L0}.mlp.down_proj.weight_scale in model.safetensors: quantization_config.weight_block_size=[128, 128] "
        "in config.json (128x128 block weight scales, dynamic 1x128 input groups) names each linear's weight scale "
        "weight_scale_inv, not weight_scale"
    )
