"""The prefill from graphed pieces: a packed forward through PrefillGraphs' static buffers, padded to
its token bucket, gives the logits and writes the K/V of the eager forward: fresh chunks,
continuations, a decode tail, forwards of falling sizes (the rows a larger one left behind must not
reach a dynamic input scale). On a CPU the pieces run eagerly over the same buffers; on CUDA they
are captured graphs."""

import numpy as np
import pytest
import torch
from checkpoint_helpers import TINY, llama_tensors

from fp8route import Fp8Linear
from fp8route.engine import CausalLM
from fp8route.engine.prefill_graphs import PrefillGraphs, token_buckets, why_not_graphed
from fp8route.engine.runner import DecodeRows, _upload_parts
from fp8route.models import LlamaConfig

CONFIG = {**TINY, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
BLOCK = 4
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model(device: str, fp8: bool, weights: torch.dtype = torch.float32) -> CausalLM:
    tensors = {n: t.to(device, weights) for n, t in llama_tensors(CONFIG).items()}
    linears = {}
    if fp8:  # no input scale: each linear quantizes x with a scale from its amax, padded rows included
        for name in [n for n in tensors if n.rsplit(".", 2)[-2] in PROJECTIONS]:
            linears[name.removesuffix(".weight")] = Fp8Linear.from_float(tensors.pop(name))
    return CausalLM(
        LlamaConfig.from_hf(CONFIG), linears, tensors, max_batch_size=6, max_seq_len=64, dtype=torch.float32,
        device=device, use_cuda_graphs=True, num_blocks=100, block_size=BLOCK,
    )  # fmt: skip


def test_token_buckets_step_by_128_above_64_and_end_at_the_maximum():
    assert token_buckets(2048)[:5] == [16, 32, 64, 128, 256] and token_buckets(2048)[-1] == 2048
    assert token_buckets(300) == [16, 32, 64, 128, 256, 300]
    assert token_buckets(40) == [16, 32, 40]
    steps = token_buckets(2048)
    assert all(b - a <= 128 for a, b in zip(steps[3:], steps[4:], strict=False))


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8-dynamic-scale"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_graphed_pieces_give_the_eager_forward(device, fp8):
    g = torch.Generator().manual_seed(0)
    vocab = CONFIG["vocab_size"]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (37, 21, 12, 9, 30)]
    graphed, eager = model(device, fp8), model(device, fp8)
    graphed.runner.prefill_graphs = PrefillGraphs(
        graphed.model, 64, torch.device(device), torch.float32, capture=device == "cuda"
    )
    eager.runner.use_prefill_graphs = False
    held = {}
    for lm in (graphed, eager):
        held[lm] = []
        for row, p in enumerate(prompts):
            taken = lm.blocks.allocate(-(-(len(p) + 1) // BLOCK))
            lm.pool.set_rows([row], [taken])
            held[lm].append(taken)
    # Falling sizes: 58 tokens, then 33 (a continuation after a cached head, and a fresh chunk), then
    # a fresh chunk with three decoding rows at its end (13 tokens), each into a smaller bucket.
    forwards = [
        lambda b: ([prompts[0], prompts[1]], [0, 0], [0, 1], [b[0], b[1]], [0, 1], None),
        lambda b: ([prompts[4][:24]], [0], [4], [b[4]], [0], None),
        lambda b: ([prompts[4][24:], prompts[2]], [24, 0], [4, 2], [b[4], b[2]], [0, 1], None),
        lambda b: (
            [prompts[3]],
            [0],
            [3],
            [b[3]],
            [0],
            DecodeRows([p[-1] for p in prompts[:3]], [len(p) - 1 for p in prompts[:3]], [0, 1, 2], b[:3]),
        ),  # fmt: skip
    ]
    with torch.no_grad():
        for i, forward in enumerate(forwards):
            ours = graphed.runner.prefill(*forward(held[graphed]))
            theirs = eager.runner.prefill(*forward(held[eager]))
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4, msg=lambda m, i=i: f"forward {i}: {m}")
    assert graphed.runner.prefill_graphs.pieces.keys() == {64, 32, 16}
    torch.testing.assert_close(graphed.pool.k, eager.pool.k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(graphed.pool.v, eager.pool.v, rtol=1e-4, atol=1e-4)


def test_a_forward_past_the_largest_bucket_runs_eagerly():
    lm = model("cpu", False)
    lm.runner.prefill_graphs = PrefillGraphs(lm.model, 16, torch.device("cpu"), torch.float32, capture=False)
    taken = lm.blocks.allocate(5)
    lm.pool.set_rows([0], [taken])
    with torch.no_grad():
        lm.runner.prefill([list(range(17))], [0], [0], [taken], [0])
        assert not lm.runner.prefill_graphs.pieces
        lm.runner.prefill([list(range(16))], [0], [0], [taken], [0])
        assert list(lm.runner.prefill_graphs.pieces) == [16]


def test_graphs_refuse_row_parallel_projections_or_biases_after_the_attention():
    lm = model("cpu", False)
    assert why_not_graphed(lm.model) is None
    lm.model.layers[1].mlp.down_proj.add_rms_norm = lambda *args: None  # what a row-parallel projection offers
    assert "tensor parallel" in str(why_not_graphed(lm.model))
    lm = model("cpu", False)
    lm.model.layers[0].self_attn.o_proj.bias = torch.nn.Parameter(torch.ones(CONFIG["hidden_size"]))
    assert "bias" in str(why_not_graphed(lm.model))  # o_proj(0) = bias: padded rows would reach the MLP's amax


def test_the_buffers_hold_the_forwards_dtype_not_the_weights():
    graphed, eager = model("cpu", False, torch.bfloat16), model("cpu", False, torch.bfloat16)
    graphed.runner.prefill_graphs = PrefillGraphs(graphed.model, 32, torch.device("cpu"), torch.float32, capture=False)
    eager.runner.use_prefill_graphs = False
    outs = []
    for lm in (graphed, eager):
        taken = lm.blocks.allocate(5)
        lm.pool.set_rows([0], [taken])
        with torch.no_grad():
            outs.append(lm.runner.prefill([list(range(1, 18))], [0], [0], [taken], [0]))
    assert graphed.runner.prefill_graphs.pieces and outs[0].dtype == torch.float32
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_the_packed_inputs_reach_the_device_as_aligned_views():
    parts = [np.arange(n, dtype=np.int64) + 100 * n for n in (3, 5, 2, 1, 7)]
    views = _upload_parts(parts, torch.device("cpu"))
    for part, view in zip(parts, views, strict=True):
        assert view.tolist() == part.tolist() and view.data_ptr() % 16 == 0


def test_graphs_first_made_under_inference_mode_serve_a_forward_outside_it():
    lm = model("cpu", False)
    taken = lm.blocks.allocate(5)
    lm.pool.set_rows([0], [taken])
    with torch.inference_mode():  # as a caller's scoring loop might make the first prefill
        lm.runner.prefill_graphs = PrefillGraphs(lm.model, 32, torch.device("cpu"), torch.float32, capture=False)
        first = lm.runner.prefill([list(range(1, 18))], [0], [0], [taken], [0])
    with torch.no_grad():
        again = lm.runner.prefill([list(range(1, 18))], [0], [0], [taken], [0])
    torch.testing.assert_close(first, again)
