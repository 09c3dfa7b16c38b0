"""model(ids) checks its ids as generate does: the same helper, the same one-line messages."""

import pytest
import torch
from checkpoint_helpers import TINY, llama_tensors
from helpers import build_lm

from fp8route import Fp8InputError
from fp8route.engine import EngineConfig
from fp8route.models import LlamaConfig, LlamaForCausalLM

VOCAB = TINY["vocab_size"]
CFG = LlamaConfig.from_hf({**TINY, "max_position_embeddings": 48})


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "CausalLM"])
def model(request):
    tensors = llama_tensors(dtype=torch.float32)
    if request.param == "CausalLM":
        return build_lm(CFG, {}, tensors, EngineConfig(dtype="float32", max_num_seqs=2))
    return LlamaForCausalLM(CFG, {}, tensors)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (torch.tensor([[1, VOCAB]]), f"token ids must be in 0..{VOCAB - 1} (the vocabulary), got 1..{VOCAB}"),
        (torch.tensor([[-1, 3]]), f"token ids must be in 0..{VOCAB - 1} (the vocabulary), got -1..3"),
        (torch.tensor([[1.0, 2.0]]), "input_ids must be an integer tensor [B, T], got torch.float32 (1, 2)"),
        (torch.tensor([[True, False]]), "input_ids must be an integer tensor [B, T], got torch.bool (1, 2)"),
        (torch.tensor([1, 2, 3]), "input_ids must be an integer tensor [B, T], got torch.int64 (3,)"),
        ([[1, 2]], "input_ids must be an integer tensor [B, T], got [[1, 2]]"),
        (torch.zeros(1, 0, dtype=torch.int64), "input_ids (1, 0) has no tokens"),
        (
            torch.zeros(1, 49, dtype=torch.int64),
            "input_ids has 49 positions, more than the model's max_position_embeddings=48; shorten the input",
        ),
    ],
)
def test_bad_ids_are_one_clear_error(model, ids, message):
    with torch.no_grad(), pytest.raises(Fp8InputError) as caught:
        model(ids)
    assert str(caught.value).startswith("model(input_ids): ") and message in str(caught.value)


def test_the_longest_input_and_every_id_run(model):
    ids = torch.tensor([[0, VOCAB - 1] * 24], dtype=torch.int32)
    with torch.no_grad():
        assert model(ids).shape == (1, 48, VOCAB)


def test_generate_says_the_same():
    model = build_lm(CFG, {}, llama_tensors(dtype=torch.float32), EngineConfig(dtype="float32", max_num_seqs=2))
    with pytest.raises(Fp8InputError, match=rf"^generate: token ids must be in 0..{VOCAB - 1} \(the vocabulary\), got"):
        model.generate(torch.tensor([[1, VOCAB]]), 2)
    with pytest.raises(Fp8InputError, match=r"^generate: input_ids \(2, 0\) has no tokens"):
        model.generate(torch.zeros(2, 0, dtype=torch.int64), 2)
