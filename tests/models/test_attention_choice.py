"""The attention option: checked up front with a message a user can act on, and the host positions
FlashInfer plans from equal the device positions each decode step reads."""

import importlib.util

import pytest
import torch
from checkpoint_helpers import TINY, llama_tensors, modelopt_folder

from fp8route import Fp8InputError
from fp8route.models import CausalLM, LlamaConfig, load_model
from fp8route.models.flashinfer_attention import check_attention


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


def test_generate_gives_each_step_its_positions_on_the_host_when_the_model_plans_from_them():
    model = CausalLM(LlamaConfig.from_hf(TINY), {}, llama_tensors(), max_batch_size=4, max_seq_len=32)
    model.plans_on_host = True  # as with FlashInfer attention, which needs CUDA
    seen = []
    step = model.step

    def recording_step(tokens, positions, limit=None, host_positions=None):
        seen.append((positions.tolist(), list(host_positions)))
        return step(tokens, positions, limit, host_positions)

    model.step = recording_step  # type: ignore[method-assign]
    ids = torch.randint(0, TINY["vocab_size"], (3, 6), generator=torch.Generator().manual_seed(0))
    model.generate(ids, 5, prompt_lengths=[6, 2, 4], pad_token_id=0)
    assert len(seen) == 4 and all(device == host for device, host in seen)
    assert seen[0][1] == [6, 2, 4] and seen[-1][1] == [9, 5, 7]


def test_a_model_that_does_not_plan_on_the_host_gets_no_host_positions():
    model = CausalLM(LlamaConfig.from_hf(TINY), {}, llama_tensors(), max_batch_size=4, max_seq_len=32)
    seen = []
    step = model.step

    def recording_step(tokens, positions, limit=None, host_positions=None):
        seen.append(host_positions)
        return step(tokens, positions, limit, host_positions)

    model.step = recording_step  # type: ignore[method-assign]
    model.generate(torch.zeros(1, 4, dtype=torch.int64), 3)
    assert seen == [None, None]
