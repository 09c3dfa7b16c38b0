"""FP8 KV-cache scales: read from ModelOpt and compressed-tensors checkpoints into the engine's pool,
1.0 with one warning when a checkpoint has none, refused when partial, written by `quantize --kv-cache
fp8` (amax / 448 of the rotated key and of the value) and used by `eval --kv-cache-dtype`."""

import logging

import pytest
import torch
from checkpoint_helpers import (
    MODELOPT_HF_QUANT,
    TINY,
    ct_config,
    fp8_llama,
    llama_tensors,
    synthetic_gguf_metadata,
    write_checkpoint,
)

from fp8route import CheckpointError, Fp8InputError
from fp8route.checkpoint.quantize import quantize_checkpoint
from fp8route.cli import LOG_FORMAT
from fp8route.engine import load_model
from fp8route.engine.kv_quant import FP8_KV, KVScales, quantize_kv
from fp8route.models import LlamaConfig

LAYERS = TINY["num_hidden_layers"]
K_SCALES, V_SCALES = (0.031, 0.047), (0.0052, 0.0071)


def with_kv_scales(names: str, shape: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    tensors = fp8_llama()
    for i in range(LAYERS):
        attn = f"model.layers.{i}.self_attn"
        k, v = (
            (f"{attn}.k_proj.k_scale", f"{attn}.v_proj.v_scale")
            if names == "proj"
            else (f"{attn}.k_scale", f"{attn}.v_scale")
        )
        tensors[k] = torch.tensor(K_SCALES[i]).reshape(shape)
        tensors[v] = torch.tensor(V_SCALES[i]).reshape(shape)
    return tensors


def modelopt_kv(folder):
    quant = {**MODELOPT_HF_QUANT, "quantization": {**MODELOPT_HF_QUANT["quantization"], "kv_cache_quant_algo": "FP8"}}
    return write_checkpoint(folder, with_kv_scales("proj"), TINY, **{"hf_quant_config.json": quant})


def test_modelopt_scales_on_k_proj_and_v_proj_reach_the_pool(tmp_path):
    model = load_model(
        modelopt_kv(tmp_path / "mo"), device="cpu", dtype=torch.float32, max_model_len=64, kv_cache_dtype="fp8"
    )
    assert model.engine.runner.pool.dtype == FP8_KV and model.config.kv_cache_dtype == "fp8"
    assert model.engine.kv_cache.scales.k == pytest.approx(
        K_SCALES
    ) and model.engine.kv_cache.scales.v == pytest.approx(V_SCALES)
    assert model.engine.runner.pool.layer_scales(1) == pytest.approx((K_SCALES[1], V_SCALES[1]))
    out = model.generate(torch.randint(0, TINY["vocab_size"], (2, 6)), 4)
    assert out.shape == (2, 10)
    auto = load_model(modelopt_kv(tmp_path / "mo2"), device="cpu", dtype=torch.float32, max_model_len=64)
    assert (
        auto.engine.runner.pool.dtype == torch.float32 and auto.engine.kv_cache.scales is None
    )  # "auto": no checkpoint scales


def test_compressed_tensors_kv_cache_scheme_scales_on_the_attention(tmp_path):
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    config = {**TINY, "quantization_config": {**ct_config(), "kv_cache_scheme": scheme}}
    folder = write_checkpoint(tmp_path / "ct", with_kv_scales("attn", (1,)), config)
    model = load_model(folder, device="cpu", dtype=torch.float32, max_model_len=64, kv_cache_dtype="fp8")
    assert model.engine.kv_cache.scales.k == pytest.approx(
        K_SCALES
    ) and model.engine.kv_cache.scales.v == pytest.approx(V_SCALES)


def test_no_scales_means_one_and_one_warning(tmp_path, caplog):
    folder = write_checkpoint(tmp_path / "plain", fp8_llama(), TINY, **{"hf_quant_config.json": MODELOPT_HF_QUANT})
    with caplog.at_level(logging.WARNING, logger="fp8route"):
        model = load_model(folder, device="cpu", dtype=torch.float32, max_model_len=64, kv_cache_dtype="fp8")
    records = [r for r in caplog.records if "kv_cache_dtype" in r.getMessage()]
    warnings = [r.getMessage() for r in records]
    assert len(warnings) == 1 and "1.0" in warnings[0] and "no KV-cache scales" in warnings[0]
    assert "\n" not in warnings[0]
    # As the command line prints it: the logger's name once, not "fp8route: fp8route:".
    assert logging.Formatter(LOG_FORMAT).format(records[0]).startswith("WARNING fp8route: kv_cache_dtype='fp8' ")
    assert model.engine.kv_cache.scales == KVScales.ones(LAYERS)
    bf16 = write_checkpoint(tmp_path / "bf16", llama_tensors(), TINY)  # an unquantized checkpoint: the same
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fp8route"):
        load_model(bf16, device="cpu", dtype=torch.float32, max_model_len=64, kv_cache_dtype="fp8")
    assert sum("kv_cache_dtype" in r.getMessage() for r in caplog.records) == 1


def test_partial_scales_and_bad_values_are_refused(tmp_path):
    tensors = with_kv_scales("proj")
    del tensors["model.layers.1.self_attn.v_proj.v_scale"]
    folder = write_checkpoint(tmp_path / "partial", tensors, TINY, **{"hf_quant_config.json": MODELOPT_HF_QUANT})
    with pytest.raises(CheckpointError, match="missing layer 1 v_scale"):
        load_model(folder, device="cpu", dtype=torch.float32, max_model_len=64, kv_cache_dtype="fp8")
    with pytest.raises(Fp8InputError, match=r"kv_cache_dtype must be one of auto, fp8, got 'e4m3'"):
        load_model(folder, device="cpu", kv_cache_dtype="e4m3")


@pytest.mark.parametrize("format", ["modelopt", "compressed-tensors"])
def test_quantize_kv_cache_fp8_calibrates_the_rotated_key_and_value(tmp_path, format):
    src = write_checkpoint(tmp_path / "src", llama_tensors(), TINY)
    calib = [torch.randint(0, TINY["vocab_size"], (24,), generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    dst = tmp_path / "dst"
    report = quantize_checkpoint(src, dst, format=format, calib=calib, device="cpu", kv_cache="fp8")
    assert len(report.kv_scales) == 2 * LAYERS and report.record["kv_cache"]["dtype"] == "fp8"
    model = load_model(dst, device="cpu", dtype=torch.float32, max_model_len=64, kv_cache_dtype="fp8")
    # Independently: layer 0's rotated keys on the calibration tokens, from the float model's own weights.
    from fp8route.kernels.fused import rope
    from fp8route.models.llama import LlamaForCausalLM, rope_tables

    cfg = LlamaConfig.from_hf(TINY)
    ref = LlamaForCausalLM(cfg, {}, {n: t.float() for n, t in llama_tensors().items()})
    attn = ref.model.layers[0].self_attn
    amax = 0.0
    for ids in calib:
        x = ref.model.layers[0].input_layernorm(ref.model.embed_tokens(ids[None]).float())
        cos, sin = rope_tables(cfg, torch.arange(len(ids)))
        k = rope(attn.k_proj(x).reshape(1, len(ids), -1, cfg.head_size), cos, sin)
        amax = max(amax, float(k.abs().max()))
    assert model.engine.kv_cache.scales.k[0] == pytest.approx(amax / 448, rel=1e-5)
    assert float(quantize_kv(torch.tensor([amax]), model.engine.kv_cache.scales.k[0]).float()) == 448.0
    with pytest.raises(Fp8InputError, match="kv_cache must be one of fp8"):
        quantize_checkpoint(src, tmp_path / "bad", format=format, calib=calib, device="cpu", kv_cache="int8")


def test_eval_kv_cache_dtype_rounds_k_and_v(tmp_path):
    from fp8route.checkpoint.gguf_tokenizer import write_tokenizer
    from fp8route.evaluation.loading import load_for_eval

    folder = modelopt_kv(tmp_path / "mo")
    write_tokenizer(synthetic_gguf_metadata(), folder)  # load_for_eval reads one; nothing here tokenizes
    plain, _ = load_for_eval(folder, "cpu", torch.float32)
    fp8, _ = load_for_eval(folder, "cpu", torch.float32, kv_cache_dtype="fp8")
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = plain(ids), fp8(ids)
    assert not torch.equal(a, b) and ((a - b).norm() / a.norm()).item() < 2e-2
