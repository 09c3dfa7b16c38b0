import pytest
from checkpoint_helpers import text_model_folder


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A tiny FP8 Llama with a byte-level BPE tokenizer and a chat template; context 256 tokens."""
    return text_model_folder(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="session")
def server(tiny_folder, tmp_path_factory):
    """One server for the tests that leave it as they found it: API key on, 32 running at once, async
    scheduling on (a GPU's default; the CPU's is off), float32: in bfloat16 the tiny model's logits
    have one-ulp gaps between its top two tokens, which a different batching's rounding flips."""
    from serve_helpers import API_KEY, MODEL, Server

    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--served-model-name", MODEL, "--api-key", API_KEY, "--max-num-seqs", "32", "--async-scheduling"]
    args += ["--dtype", "float32"]
    running = Server(tiny_folder, log, *args, "--max-num-batched-tokens", "512", "--max-request-bytes", "65536")
    yield running
    assert running.stop() == 0, running.log()
