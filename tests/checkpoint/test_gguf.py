"""The GGUF reader on a file written here: metadata, F32/Q8_0/Q4_1 blocks, llama.cpp's q/k row order."""

import json
import struct

import pytest
import torch

from fp8route import CheckpointError
from fp8route.checkpoint.gguf import GgufFile, gguf_to_hf
from fp8route.checkpoint.shards import ShardSet

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 32, 2, 1, 64, 40


def _str(s: str) -> bytes:
    return struct.pack("<Q", len(s.encode())) + s.encode()


def _kv(key: str, value: object) -> bytes:
    if isinstance(value, str):
        return _str(key) + struct.pack("<I", 8) + _str(value)
    if isinstance(value, float):
        return _str(key) + struct.pack("<If", 6, value)
    if isinstance(value, list):
        return _str(key) + struct.pack("<IIQ", 9, 8, len(value)) + b"".join(_str(v) for v in value)
    return _str(key) + struct.pack("<II", 4, value)


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.reshape(-1).view(torch.uint8).tolist())


def q8_0(values: torch.Tensor) -> bytes:
    out = b""
    for block in values.reshape(-1, 32):
        d = (block.abs().max() / 127).to(torch.float16)
        q = torch.round(block / d.float()).clamp(-127, 127).to(torch.int8)
        out += _bytes(d) + _bytes(q)
    return out


def q4_1(values: torch.Tensor) -> bytes:
    out = b""
    for block in values.reshape(-1, 32):
        m = block.min().to(torch.float16)
        d = ((block.max() - m.float()) / 15).to(torch.float16)
        q = torch.round((block - m.float()) / d.float()).clamp(0, 15).to(torch.uint8)
        nibbles = q[:16] | (q[16:] << 4)
        out += _bytes(d) + _bytes(m) + _bytes(nibbles)
    return out


def dequant_q8_0(values: torch.Tensor) -> torch.Tensor:
    blocks = values.reshape(-1, 32)
    d = (blocks.abs().amax(1, keepdim=True) / 127).to(torch.float16).float()
    return (torch.round(blocks / d).clamp(-127, 127) * d).reshape(values.shape)


def dequant_q4_1(values: torch.Tensor) -> torch.Tensor:
    blocks = values.reshape(-1, 32)
    m = blocks.amin(1, keepdim=True).to(torch.float16).float()
    d = ((blocks.amax(1, keepdim=True) - m) / 15).to(torch.float16).float()
    return (torch.round((blocks - m) / d).clamp(0, 15) * d + m).reshape(values.shape)


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Hugging Face q/k weights."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, tensors: dict[str, tuple[int, torch.Tensor, bytes]], metadata: dict[str, object]) -> None:
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    header += b"".join(_kv(k, v) for k, v in metadata.items())
    data, infos = b"", b""
    for name, (kind, t, blob) in tensors.items():
        infos += _str(name) + struct.pack("<I", t.dim()) + b"".join(struct.pack("<Q", d) for d in reversed(t.shape))
        infos += struct.pack("<IQ", kind, len(data))
        data += blob + b"\0" * (-len(blob) % 32)
    head = header + infos
    path.write_bytes(head + b"\0" * (-len(head) % 32) + data)


@pytest.fixture
def model(tmp_path):
    g = torch.Generator().manual_seed(0)
    hf = {
        "self_attn.q_proj": torch.randn(HIDDEN, HIDDEN, generator=g),
        "self_attn.k_proj": torch.randn(HIDDEN // HEADS * KV_HEADS, HIDDEN, generator=g),
        "mlp.down_proj": torch.randn(HIDDEN, FFN, generator=g),
    }
    embed, norm = torch.randn(VOCAB, HIDDEN, generator=g), torch.rand(HIDDEN, generator=g)
    tensors = {
        "token_embd.weight": (8, embed, q8_0(embed)),
        "blk.0.attn_norm.weight": (0, norm, _bytes(norm)),
        "blk.0.attn_q.weight": (3, hf["self_attn.q_proj"], q4_1(llama_cpp_permute(hf["self_attn.q_proj"], HEADS))),
        "blk.0.attn_k.weight": (3, hf["self_attn.k_proj"], q4_1(llama_cpp_permute(hf["self_attn.k_proj"], KV_HEADS))),
        "blk.0.ffn_down.weight": (3, hf["mlp.down_proj"], q4_1(hf["mlp.down_proj"])),
    }
    metadata = {
        "general.architecture": "llama",
        "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": FFN,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS,
        "llama.block_count": 1,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB)],
    }
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tensors, metadata)
    return path, hf, embed, norm


def test_reads_metadata_and_dequantizes_blocks(model):
    path, hf, embed, norm = model
    gguf = GgufFile.open(path)
    assert gguf.metadata["tokenizer.ggml.tokens"][3] == "t3" and gguf.metadata["llama.block_count"] == 1
    assert gguf.tensors["blk.0.ffn_down.weight"].shape == (HIDDEN, FFN)
    assert torch.equal(gguf.tensor("blk.0.attn_norm.weight"), norm)
    torch.testing.assert_close(gguf.tensor("token_embd.weight"), dequant_q8_0(embed))
    torch.testing.assert_close(gguf.tensor("blk.0.ffn_down.weight"), dequant_q4_1(hf["mlp.down_proj"]))


def test_converts_to_hugging_face_names_and_row_order(model, tmp_path):
    path, hf, embed, _ = model
    folder = gguf_to_hf(path, tmp_path / "hf", dtype=torch.float32)
    shards = ShardSet.open(folder)
    assert set(shards.tensors) == {
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    }
    for name, original in hf.items():
        # Quantization is per block of 32 along K, so it commutes with the row permutation.
        torch.testing.assert_close(shards.read_one(f"model.layers.0.{name}.weight"), dequant_q4_1(original))
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["num_key_value_heads"] == KV_HEADS and config["tie_word_embeddings"]


def test_rejects_files_that_are_not_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGML" + b"\0" * 20)
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        GgufFile.open(tmp_path / "x.gguf")
