"""Model shapes per tensor-parallel rank."""

from __future__ import annotations

import json

import pytest

from fp8route.errors import Fp8InputError
from fp8route.models.shapes import model_shapes, parse_shapes, unique_shapes


def nk(shapes):
    return [(s.name, s.n, s.k) for s in shapes]


def test_llama_8b_tp1_and_tp4():
    assert nk(model_shapes("llama-3.1-8b")) == [
        ("qkv_proj", 6144, 4096),
        ("o_proj", 4096, 4096),
        ("gate_up_proj", 28672, 4096),
        ("down_proj", 4096, 14336),
    ]
    assert nk(model_shapes("Llama-3.1-8B", tp=4)) == [
        ("qkv_proj", 1536, 4096),
        ("o_proj", 4096, 1024),
        ("gate_up_proj", 7168, 4096),
        ("down_proj", 4096, 3584),
    ]


def test_llama_70b_tp8_and_kv_heads_replicated_past_their_count():
    assert nk(model_shapes("llama-3.1-70b", tp=8)) == [
        ("qkv_proj", 1280, 8192),
        ("o_proj", 8192, 1024),
        ("gate_up_proj", 7168, 8192),
        ("down_proj", 8192, 3584),
    ]
    # 16 ranks, 8 KV heads: each rank keeps one (replicated), 4 query heads.
    assert model_shapes("llama-3.1-70b", tp=16)[0].n == (4 + 2) * 128


@pytest.mark.parametrize("tp", [0, 3, 5])
def test_tp_that_does_not_divide_is_an_error(tp):
    with pytest.raises(Fp8InputError):
        model_shapes("llama-3.1-8b", tp=tp)


def test_config_json_file_dir_and_nested_text_config(tmp_path):
    cfg = {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    expected = [
        ("qkv_proj", 3072, 2048),
        ("o_proj", 2048, 2048),
        ("gate_up_proj", 16384, 2048),
        ("down_proj", 2048, 8192),
    ]
    assert nk(model_shapes(str(tmp_path))) == expected
    assert nk(model_shapes(str(tmp_path / "config.json"))) == expected
    (tmp_path / "mm.json").write_text(json.dumps({"text_config": {**cfg, "head_dim": 128}}))
    assert model_shapes(str(tmp_path / "mm.json"))[0].n == (32 + 16) * 128


def test_bad_models_name_the_fix(tmp_path):
    with pytest.raises(Fp8InputError, match="llama-3.1-8b"):
        model_shapes("gpt-5")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 10}))
    with pytest.raises(Fp8InputError, match="intermediate_size"):
        model_shapes(str(tmp_path))
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(Fp8InputError, match="JSON"):
        model_shapes(str(tmp_path))


def test_parse_shapes_and_dedup():
    shapes = parse_shapes("6144x4096, 4096X14336,6144x4096")
    assert nk(unique_shapes(shapes)) == [("6144x4096", 6144, 4096), ("4096x14336", 4096, 14336)]
    for bad in ("6144", "6144x", "0x16", "1x2x3"):
        with pytest.raises(Fp8InputError):
            parse_shapes(bad)
