"""The attention option: checked up front with a message a user can act on, and the host positions
FlashInfer plans from equal the device positions each decode step reads."""

import importlib.util

import pytest
import torch
from checkpoint_helpers import TINY, llama_tensors, modelopt_folder
from helpers import build_lm

from fp8route import Fp8InputError
from fp8route.engine import CausalLM, EngineConfig, load_model
from fp8route.engine.flashinfer_attention import check_attention
from fp8route.engine.runner import ModelRunner
from fp8route.models import LlamaConfig


def test_unknown_attention_names_the_choices():
    with pytest.raises(Fp8InputError, match="builtin, flashinfer"):
        check_attention("flash", torch.device("cpu"))


def test_flashinfer_without_the_extra_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # as if not installed
    with pytest.raises(Fp8InputError, match=r"pip install 'fp8route\[flashinfer\]'"):
        check_attention("flashinfer", torch.device("cuda"))


def test_flashinfer_on_cpu_is_refused_first(tmp_path):
    with pytest.raises(Fp8InputError, match="runs on CUDA GPUs; the model is on cpu"):
        load_model(modelopt_folder(tmp_path), device="cpu", attention="flashinfer")


def tiny() -> CausalLM:
    config = EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=32, block_size=4)
    return build_lm(LlamaConfig.from_hf(TINY), {}, llama_tensors(), config)


def record_decodes(monkeypatch) -> list:
    """Each decode step's device lengths and table rows beside the host lengths and blocks it got."""
    seen = []
    decode = ModelRunner.decode

    def recording(self, host, *, limit=None, host_lengths=None, host_blocks=None):
        if host_lengths is None:
            seen.append(None)
        else:
            _, _, positions, rows = host
            width = max(len(b) for b in host_blocks)
            tables = self.pool.tables[torch.from_numpy(rows), :width].tolist()
            blocks = [list(b) + [0] * (width - len(b)) for b in host_blocks]
            seen.append(((positions + 1).tolist(), list(host_lengths), tables, blocks))
        return decode(self, host, limit=limit)

    monkeypatch.setattr(ModelRunner, "decode", recording)
    return seen


def test_decode_steps_get_their_lengths_and_blocks_on_the_host_when_the_runner_plans_from_them(monkeypatch):
    model = tiny()
    monkeypatch.setattr(ModelRunner, "plans_on_host", property(lambda self: True))  # as FlashInfer's, on CUDA
    seen = record_decodes(monkeypatch)
    ids = torch.randint(0, TINY["vocab_size"], (3, 6), generator=torch.Generator().manual_seed(0))
    model.generate(ids, 5, prompt_lengths=[6, 2, 4], pad_token_id=0)
    assert len(seen) == 4 and all(device == host for device, host, _, _ in seen)
    assert all(tables == blocks for _, _, tables, blocks in seen)  # the host blocks are the device table's
    assert seen[0][1] == [7, 3, 5] and seen[-1][1] == [10, 6, 8]


def test_a_runner_that_does_not_plan_on_the_host_gets_no_host_lengths(monkeypatch):
    model = tiny()
    seen = record_decodes(monkeypatch)
    model.generate(torch.zeros(1, 4, dtype=torch.int64), 3)
    assert seen == [None, None]
