"""A mixed step from graphed pieces: a flat forward through PrefillGraphs' static buffers, padded to
its token bucket, gives the logits and writes the K/V of the eager forward: fresh chunks,
continuations, decode rows, forwards of falling sizes (the rows a larger one left behind must not
reach a dynamic input scale). On a CPU the pieces run eagerly over the same buffers; on CUDA they
are captured graphs."""

import os

import numpy as np
import pytest
import torch
from checkpoint_helpers import TINY, llama_tensors
from helpers import build_lm

from fp8route import Fp8Linear, SamplingParams
from fp8route.engine import CausalLM, EngineConfig
from fp8route.engine.blocks import SCRATCH_BLOCK
from fp8route.engine.kv_pool import upload_parts
from fp8route.engine.prefill_graphs import PrefillGraphs, token_buckets, why_not_graphed
from fp8route.engine.request import Request, RequestMetrics
from fp8route.engine.scheduler_output import NewRequest, ScheduledSeq, SchedulerOutput
from fp8route.models import LlamaConfig

INTERPRETED = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on a CPU"),
]
CONFIG = {**TINY, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
BLOCK = 4
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model(device: str, fp8: bool, weights: torch.dtype = torch.float32) -> CausalLM:
    tensors = {n: t.to(device, weights) for n, t in llama_tensors(CONFIG).items()}
    linears = {}
    if fp8:  # no input scale: each linear quantizes x with a scale from its amax, padded rows included
        for name in [n for n in tensors if n.rsplit(".", 2)[-2] in PROJECTIONS]:
            linears[name.removesuffix(".weight")] = Fp8Linear.from_float(tensors.pop(name))
    config = EngineConfig(
        dtype="float32", device=device, max_num_seqs=6, max_model_len=64, num_kv_blocks=100, block_size=BLOCK,
        use_cuda_graphs=device == "cuda",
    )  # fmt: skip
    return build_lm(LlamaConfig.from_hf(CONFIG), linears, tensors, config)


def request(lm: CausalLM, row: int, prompt: list[int]) -> Request:
    """A request holding table row `row` and blocks for its prompt and one token more, given to the runner."""
    r = Request(str(row), prompt, SamplingParams(max_tokens=1), 0, RequestMetrics(0.0))
    r.row, r.blocks = row, lm.engine.blocks.allocate(-(-(len(prompt) + 1) // BLOCK))
    new = NewRequest(r.request_id, row, r.params, r.seed, tuple(prompt), (), tuple(r.blocks))
    lm.engine.runner._take_in(SchedulerOutput(new_requests=[new]))
    return r


def forward(lm: CausalLM, pieces: list[tuple[Request, int, int]]) -> torch.Tensor:
    """One step of these (request, start, tokens) pieces, each sampling: their last tokens' logits."""
    seqs = [
        ScheduledSeq(r.request_id, r.row, start, n, r.token_ids[start : start + n], True, 0) for r, start, n in pieces
    ]
    return lm.engine.runner._forward(SchedulerOutput(seqs), lm.engine.runner.fresh_min_tokens)[0]


def falling_sizes_match(graphed: CausalLM, eager: CausalLM, seed: int) -> None:
    """Forwards of falling sizes through graphed's PrefillGraphs and eager's eager forward: the same
    logits, and the same K/V in the pools after. 58 tokens, then 24 (a prompt alone), then 18 (a
    continuation after a cached head, and a fresh chunk), then three decoding rows and a fresh chunk
    (12 tokens), into falling buckets: the rows a larger forward left must not reach a smaller one."""
    g = torch.Generator().manual_seed(seed)
    vocab = CONFIG["vocab_size"]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (37, 21, 12, 9, 30)]
    eager.engine.runner.use_prefill_graphs = False
    held = {lm: [request(lm, row, p) for row, p in enumerate(prompts)] for lm in (graphed, eager)}
    forwards = [
        lambda r: [(r[0], 0, 37), (r[1], 0, 21)],
        lambda r: [(r[4], 0, 24)],
        lambda r: [(r[4], 24, 6), (r[2], 0, 12)],
        lambda r: [(r[0], 36, 1), (r[1], 20, 1), (r[2], 11, 1), (r[3], 0, 9)],
    ]
    with torch.no_grad():
        for i, pieces in enumerate(forwards):
            ours, theirs = forward(graphed, pieces(held[graphed])), forward(eager, pieces(held[eager]))
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4, msg=lambda m, i=i: f"forward {i}: {m}")
    # Every block but the scratch one, where padded rows write K/V (whatever a graph's rows held) by design.
    ours, theirs = graphed.engine.runner.pool, eager.engine.runner.pool
    assert SCRATCH_BLOCK == 0
    torch.testing.assert_close(ours.k[:, 1:], theirs.k[:, 1:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.v[:, 1:], theirs.v[:, 1:], rtol=1e-4, atol=1e-4)


def test_token_buckets_step_by_128_above_64_and_end_at_the_maximum():
    assert token_buckets(2048)[:5] == [16, 32, 64, 128, 256] and token_buckets(2048)[-1] == 2048
    assert token_buckets(300) == [16, 32, 64, 128, 256, 300]
    assert token_buckets(40) == [16, 32, 40]
    steps = token_buckets(2048)
    assert all(b - a <= 128 for a, b in zip(steps[3:], steps[4:], strict=False))


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8-dynamic-scale"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_graphed_pieces_give_the_eager_forward(device, fp8):
    graphed, eager = model(device, fp8), model(device, fp8)
    graphed.engine.runner.prefill_graphs = PrefillGraphs(
        graphed.module.model, 64, torch.device(device), torch.float32, capture=device == "cuda"
    )
    falling_sizes_match(graphed, eager, seed=0)
    assert graphed.engine.runner.prefill_graphs.pieces.keys() == {64, 32, 16}


def test_a_forward_past_the_largest_bucket_runs_eagerly():
    lm = model("cpu", False)
    runner = lm.engine.runner
    runner.prefill_graphs = PrefillGraphs(lm.module.model, 16, torch.device("cpu"), torch.float32, capture=False)
    r = request(lm, 0, list(range(17)))
    with torch.no_grad():
        forward(lm, [(r, 0, 17)])
        assert not runner.prefill_graphs.pieces
        forward(lm, [(r, 0, 16)])
        assert list(runner.prefill_graphs.pieces) == [16]


def test_graphs_refuse_row_parallel_projections_or_biases_after_the_attention():
    lm = model("cpu", False)
    assert why_not_graphed(lm.module.model) is None
    lm.module.model.layers[1].mlp.down_proj.add_rms_norm = lambda *args: None  # what a row-parallel projection offers
    assert "tensor parallel" in str(why_not_graphed(lm.module.model))
    lm = model("cpu", False)
    lm.module.model.layers[0].self_attn.o_proj.bias = torch.nn.Parameter(torch.ones(CONFIG["hidden_size"]))
    assert "bias" in str(why_not_graphed(lm.module.model))  # o_proj(0) = bias: padded rows would reach the MLP's amax


def test_the_buffers_hold_the_forwards_dtype_not_the_weights():
    graphed, eager = model("cpu", False, torch.bfloat16), model("cpu", False, torch.bfloat16)
    graphed.engine.runner.prefill_graphs = PrefillGraphs(
        graphed.module.model, 32, torch.device("cpu"), torch.float32, capture=False
    )
    eager.engine.runner.use_prefill_graphs = False
    outs = []
    for lm in (graphed, eager):
        with torch.no_grad():
            outs.append(forward(lm, [(request(lm, 0, list(range(1, 18))), 0, 17)]))
    assert graphed.engine.runner.prefill_graphs.pieces and outs[0].dtype == torch.float32
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_the_packed_inputs_reach_the_device_as_aligned_views():
    for dtype in (np.int64, np.float32):  # the runner's inputs, the sampler's per-row values
        parts = [np.arange(n, dtype=dtype) + 100 * n for n in (3, 5, 2, 1, 7)]
        views = upload_parts(parts, torch.device("cpu"))
        for part, view in zip(parts, views, strict=True):
            assert view.tolist() == part.tolist() and view.data_ptr() % 16 == 0


def test_graphs_first_made_under_inference_mode_serve_a_forward_outside_it():
    lm = model("cpu", False)
    r = request(lm, 0, list(range(1, 18)))
    with torch.inference_mode():  # as a caller's scoring loop might make the first forward
        lm.engine.runner.prefill_graphs = PrefillGraphs(
            lm.module.model, 32, torch.device("cpu"), torch.float32, capture=False
        )
        first = forward(lm, [(r, 0, 17)])
    with torch.no_grad():
        again = forward(lm, [(r, 0, 17)])
    torch.testing.assert_close(first, again)


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8-dynamic-scale"])
@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cpu", marks=INTERPRETED),  # the kernels under Triton's interpreter
        pytest.param("cuda", marks=pytest.mark.gpu),
    ],
)
def test_whole_step_graphs_run_the_attention_inside_and_give_the_eager_forward(device, fp8):
    """Attached to the pool, a step's attention runs inside its bucket's graph from the static inputs (the
    paged kernel reading the step's counts on the device): the same logits and K/V as the eager forward
    through the kernels, for falling sizes (a larger step's slots must not take the padded rows' K/V), a
    continuation, decode rows beside a chunk; a step whose fresh chunks attend on their own (20 tokens
    or more of them here) runs the pieces."""
    graphed, eager = model(device, fp8), model(device, fp8)
    for lm in (graphed, eager):
        lm.engine.runner.use_triton = True
        lm.engine.runner.fresh_min_tokens = 20
    runner = graphed.engine.runner
    runner.prefill_graphs = PrefillGraphs(
        graphed.module.model, 64, torch.device(device), torch.float32, capture=device == "cuda"
    )
    runner.prefill_graphs.attach(runner.pool, runner.max_rows, runner.rope_cos.dtype)
    falling_sizes_match(graphed, eager, seed=1)
    # The first two forwards (58 and 24 fresh tokens) run the pieces, the next two (12 and 9) whole steps.
    assert runner.prefill_graphs.steps.keys() == {32, 16} and runner.prefill_graphs.pieces.keys() == {64, 32}


def test_a_new_pool_detaches_the_whole_step_graphs():
    lm = model("cpu", False)
    runner = lm.engine.runner
    runner.prefill_graphs = PrefillGraphs(lm.module.model, 32, torch.device("cpu"), torch.float32, capture=False)
    runner.prefill_graphs.attach(runner.pool, runner.max_rows, runner.rope_cos.dtype)
    runner.set_pool(8)
    assert runner.prefill_graphs.inputs is None and not runner.prefill_graphs.steps
