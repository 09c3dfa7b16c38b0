"""The compact Llama runner: causal, GQA as repeated heads, fused projections equal to their members."""

import math

import pytest
import torch
from checkpoint_helpers import TINY, llama_tensors

from fp8route import CheckpointError
from fp8route.models import LlamaConfig, LlamaForCausalLM
from fp8route.models.llama import FloatLinear, rope_inv_freq, rope_tables

CFG = LlamaConfig.from_hf(TINY)
IDS = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))


def logits(tensors, config=CFG, linears=None, dtype=torch.float32):
    with torch.no_grad():
        return LlamaForCausalLM(config, linears or {}, tensors)(IDS, dtype=dtype)


def test_shapes_and_causality():
    tensors = llama_tensors()
    out = logits(tensors)
    assert out.shape == (2, 12, TINY["vocab_size"]) and out.dtype == torch.float32
    changed = IDS.clone()
    changed[:, 7] = (changed[:, 7] + 1) % TINY["vocab_size"]
    with torch.no_grad():
        out2 = LlamaForCausalLM(CFG, {}, tensors)(changed, dtype=torch.float32)
    assert torch.equal(out[:, :7], out2[:, :7]) and not torch.allclose(out[:, 7:], out2[:, 7:])


def test_gqa_equals_attention_with_repeated_kv_heads():
    tensors = {k: v.float() for k, v in llama_tensors().items()}
    mha = {**TINY, "num_key_value_heads": TINY["num_attention_heads"]}
    repeated = dict(tensors)
    groups = TINY["num_attention_heads"] // TINY["num_key_value_heads"]
    head = TINY["hidden_size"] // TINY["num_attention_heads"]
    for i in range(TINY["num_hidden_layers"]):
        for m in ("k_proj", "v_proj"):
            name = f"model.layers.{i}.self_attn.{m}.weight"
            w = tensors[name].reshape(TINY["num_key_value_heads"], head, -1)
            repeated[name] = w.repeat_interleave(groups, dim=0).reshape(-1, w.shape[-1])
    torch.testing.assert_close(logits(tensors), logits(repeated, LlamaConfig.from_hf(mha)), rtol=1e-5, atol=1e-5)


def test_fused_projections_equal_their_members():
    tensors = {k: v.float() for k, v in llama_tensors().items()}
    fused = {}
    for i in range(TINY["num_hidden_layers"]):
        p = f"model.layers.{i}"
        fused[f"{p}.self_attn.qkv_proj"] = FloatLinear(
            torch.cat([tensors[f"{p}.self_attn.{m}_proj.weight"] for m in "qkv"])
        )
        fused[f"{p}.mlp.gate_up_proj"] = FloatLinear(
            torch.cat([tensors[f"{p}.mlp.{m}_proj.weight"] for m in ("gate", "up")])
        )
    model = LlamaForCausalLM(CFG, fused, tensors)
    assert not hasattr(model.model.layers[0].self_attn, "q_proj")
    torch.testing.assert_close(logits(tensors, linears=fused), logits(tensors), rtol=1e-5, atol=1e-5)


def test_bf16_compute_stays_close_to_fp32():
    tensors = llama_tensors()
    out = logits(tensors, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    ref = logits(tensors)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 0.02


def test_llama3_rope_scaling_slows_only_long_wavelengths():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    plain = rope_inv_freq(CFG)
    scaled = rope_inv_freq(LlamaConfig.from_hf({**TINY, "rope_scaling": scaling}))
    wavelen = 2 * math.pi / plain
    assert torch.equal(scaled[wavelen < 64 / 4], plain[wavelen < 64 / 4])
    torch.testing.assert_close(scaled[wavelen > 64], plain[wavelen > 64] / 8)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"architectures": ["GemmaForCausalLM"]}, r"unsupported: architectures=\['GemmaForCausalLM'\]"),
        ({"hidden_act": "gelu"}, "unsupported: hidden_act=gelu"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported: rope_scaling.rope_type=yarn"),
    ],
)
def test_unsupported_configs(change, match):
    with pytest.raises(CheckpointError, match=match):
        rope_inv_freq(LlamaConfig.from_hf({**TINY, **change}))


def test_missing_lm_head_without_tied_embeddings():
    tensors = llama_tensors()
    del tensors["lm_head.weight"]
    with pytest.raises(CheckpointError, match="lm_head.weight is missing and tie_word_embeddings is false"):
        LlamaForCausalLM(CFG, {}, tensors)


def test_fused_residual_path_equals_the_layer_by_layer_forward():
    """run_layers (residual adds fused into the following norms) is norm(layer(...layer(h)))."""
    cfg = LlamaConfig.from_hf(TINY)
    model = LlamaForCausalLM(cfg, {}, llama_tensors(TINY))
    h = torch.randn(2, 5, cfg.hidden_size)
    cos, sin = rope_tables(cfg, torch.arange(5))
    expected = h
    for layer in model.model.layers:
        expected = layer(expected, cos, sin)
    torch.testing.assert_close(model.model.run_layers(h, cos, sin), model.model.norm(expected))
