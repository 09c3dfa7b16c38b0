"""The attention option: checked up front with a message a user can act on, and the host positions
FlashInfer plans from equal the device positions each decode step reads."""

import importlib.util

import pytest
import torch
from checkpoint_helpers import TINY, llama_tensors, modelopt_folder

from fp8route import Fp8InputError
from fp8route.engine import CausalLM, load_model
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
        load_model(modelopt_folder(tmp_path), "cpu", attention="flashinfer")


def test_generate_gives_each_step_its_lengths_and_blocks_on_the_host_when_the_model_plans_from_them(monkeypatch):
    model = CausalLM(LlamaConfig.from_hf(TINY), {}, llama_tensors(), max_batch_size=4, max_seq_len=32)
    monkeypatch.setattr(ModelRunner, "plans_on_host", property(lambda self: True))  # as FlashInfer's, on CUDA
    seen = []
    step = model.step

    def recording_step(tokens, positions, rows, limit=None, host_lengths=None, host_blocks=None):
        tables = model.pool.tables[rows, : len(host_blocks[0])].tolist()
        seen.append(((positions + 1).tolist(), list(host_lengths), tables, [list(b) for b in host_blocks]))
        return step(tokens, positions, rows, limit, host_lengths, host_blocks)

    model.step = recording_step  # type: ignore[method-assign]
    ids = torch.randint(0, TINY["vocab_size"], (3, 6), generator=torch.Generator().manual_seed(0))
    model.generate(ids, 5, prompt_lengths=[6, 2, 4], pad_token_id=0)
    assert len(seen) == 4 and all(device == host for device, host, _, _ in seen)
    assert all(tables == blocks for _, _, tables, blocks in seen)  # the host blocks are the device table's
    assert seen[0][1] == [7, 3, 5] and seen[-1][1] == [10, 6, 8]


def test_a_model_that_does_not_plan_on_the_host_gets_no_host_lengths():
    model = CausalLM(LlamaConfig.from_hf(TINY), {}, llama_tensors(), max_batch_size=4, max_seq_len=32)
    seen = []
    step = model.step

    def recording_step(tokens, positions, rows, limit=None, host_lengths=None, host_blocks=None):
        seen.append(host_lengths)
        return step(tokens, positions, rows, limit, host_lengths, host_blocks)

    model.step = recording_step  # type: ignore[method-assign]
    model.generate(torch.zeros(1, 4, dtype=torch.int64), 3)
    assert seen == [None, None]
