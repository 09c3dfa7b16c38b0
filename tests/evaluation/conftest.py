import pytest
from checkpoint_helpers import TINY, llama_tensors, synthetic_gguf_metadata, write_checkpoint

from fp8route import quantize_checkpoint
from fp8route.checkpoint.gguf_tokenizer import write_tokenizer


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory):
    """A tiny random Llama whose vocabulary is a byte-level tokenizer's, in bf16 and FP8."""
    metadata = synthetic_gguf_metadata()
    config = dict(TINY, vocab_size=len(metadata["tokenizer.ggml.tokens"]))
    root = tmp_path_factory.mktemp("eval")
    bf16 = write_checkpoint(root / "bf16", llama_tensors(config), config)
    write_tokenizer(metadata, bf16)
    quantize_checkpoint(bf16, root / "fp8", format="modelopt", device="cpu")
    return bf16, root / "fp8"
