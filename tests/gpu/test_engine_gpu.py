"""The serving engine on the GPU: Triton paged decode from CUDA graphs, mixed steps (decodes and
chunks in one forward, through the paged attention kernel and the prefill graphs), preemption and
prefix hits, checked against an independent fp32 full forward of the same weights; padded graph rows
touch only the scratch block; FP8 layers and FlashInfer attention too; async scheduling gives the
tokens the engine gives without it."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import build_lm

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CONFIG = {  # 128-wide heads, as the 8B's, so FlashInfer's kernels take them
    "architectures": ["LlamaForCausalLM"], "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
}  # fmt: skip


NUM_BLOCKS = 16  # for test_fp32_engine_...: its requests preempt each other and hit the prefix cache (seen on CPU)


def make_engine(dtype, *, num_blocks=400, budget=48, attention="builtin", linears=None, tensors=None, prefix=True):
    from fp8route.engine import EngineConfig
    from fp8route.models import LlamaConfig

    config = EngineConfig(
        dtype=dtype, device="cuda", max_num_seqs=8, max_model_len=256, num_kv_blocks=num_blocks, block_size=16,
        enable_prefix_caching=prefix, max_num_batched_tokens=budget, attention=attention,
    )  # fmt: skip
    tensors = {n: t.to("cuda", dtype) for n, t in tensors.items()}
    return build_lm(LlamaConfig.from_hf(CONFIG), linears or {}, tensors, config).engine


def run(engine, requests, params, stagger=2):
    outputs, step = {}, 0
    items = list(requests.items())
    while items or engine.has_unfinished:
        if items and step % stagger == 0:
            rid, ids = items.pop(0)
            engine.add_request(ids, params, request_id=rid)
        for update in engine.step():
            outputs.setdefault(update.request.request_id, []).extend(update.new_token_ids)
        step += 1
    assert engine.leaked() is None
    return outputs


def reference_model(tensors, linears=None):
    from fp8route.models import LlamaConfig, LlamaForCausalLM

    float_tensors = {n: t.float().cuda() for n, t in tensors.items()}
    return LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), linears or {}, float_tensors)


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"r{i}": torch.randint(0, CONFIG["vocab_size"], (5 + 13 * i % 70,), generator=g).tolist() for i in range(n)}


def assert_near_argmax(reference, prompt, output, tol=0.1, name=""):
    """Every chosen token is the fp32 reference's argmax or within tol of its logit range from it (a
    near-tie that bf16 activations, quantized to FP8 apart from fp32 ones, may break either way:
    seen up to 0.052 on the H200), and most are its argmax; a wrong kernel picks tokens far from it."""
    seq = torch.tensor([prompt + output], device="cuda")
    with torch.no_grad():
        logits = reference(seq, dtype=torch.float32)[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(output, device="cuda")[:, None])[:, 0]
    gap = (logits.max(-1).values - chosen) / (logits.max(-1).values - logits.min(-1).values)
    worst = int(gap.argmax())
    where = f"{name}: prompt of {len(prompt)}, output token {worst} (position {len(prompt) + worst})"
    assert gap.max().item() <= tol and gap.mean().item() <= tol / 5, (where, gap.tolist())


@pytest.mark.gpu
@gpu
def test_fp32_engine_equals_the_full_forward_under_batching_chunking_preemption_and_prefix_hits():
    from checkpoint_helpers import llama_tensors

    from fp8route import SamplingParams

    tensors = llama_tensors(CONFIG)
    reference = reference_model(tensors)
    shared = torch.randint(0, CONFIG["vocab_size"], (40,), generator=torch.Generator().manual_seed(9)).tolist()
    requests = {**prompts(10), **{f"p{i}": shared + [i + 1] * (i + 1) for i in range(4)}}
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine = make_engine(torch.float32, num_blocks=NUM_BLOCKS, tensors=tensors)  # too few: preemption
    engine.record_stats = True
    outputs = run(engine, requests, params)
    assert engine.scheduler.preemptions > 0 and engine.blocks.stats.hit_tokens > 0
    assert any(s.decodes and s.prefill_tokens for s in engine.stats)  # decodes and chunks in one forward
    for rid, ids in requests.items():
        seq = torch.tensor([ids], device="cuda")
        with torch.no_grad():
            for _ in range(20):
                seq = torch.cat([seq, reference(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert outputs[rid] == seq[0, len(ids) :].tolist(), rid


@pytest.mark.gpu
@gpu
def test_padded_graph_rows_write_only_the_scratch_block():
    from checkpoint_helpers import llama_tensors

    from fp8route import SamplingParams

    engine = make_engine(torch.bfloat16, tensors=llama_tensors(CONFIG))
    pool = engine.runner.pool
    for rid, ids in prompts(3).items():  # three rows: the bucket of 4 pads one
        engine.add_request(ids, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), request_id=rid)
    engine.step()  # the prefills
    owned = {b for r in engine.scheduler.running for b in r.blocks}
    free = [b for b in range(1, pool.num_blocks) if b not in owned]
    pool.k[:, free], pool.v[:, free] = float("nan"), float("nan")
    while engine.has_unfinished:
        engine.step()
        owned |= {b for r in engine.scheduler.running for b in r.blocks}
    untouched = [b for b in free if b not in owned]
    assert untouched and pool.k[:, untouched].isnan().all() and pool.v[:, untouched].isnan().all()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "attention",
    ["builtin", pytest.param("flashinfer", marks=pytest.mark.skipif(
        importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"))],
)  # fmt: skip
def test_fp8_engine_picks_what_an_fp32_forward_of_its_weights_picks(attention, tmp_path):
    from checkpoint_helpers import MODELOPT_HF_QUANT, fp8_llama, write_checkpoint

    from fp8route import Fp8Linear, SamplingParams
    from fp8route.checkpoint.load import load_checkpoint

    quant = {"hf_quant_config.json": MODELOPT_HF_QUANT}
    folder = write_checkpoint(tmp_path / "fp8", fp8_llama(config=CONFIG), CONFIG, **quant)
    checkpoint = load_checkpoint(folder, "cuda")
    assert all(isinstance(m, Fp8Linear) for m in checkpoint.linears.values())
    reference = reference_model(checkpoint.tensors, checkpoint.linears)  # the same FP8 layers, fp32 activations
    engine = make_engine(torch.bfloat16, linears=checkpoint.linears, tensors=checkpoint.tensors, attention=attention)
    engine.record_stats = True
    requests = prompts(8, seed=3)
    outputs = run(engine, requests, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert any(s.decodes and s.prefill_tokens for s in engine.stats)
    for rid, ids in requests.items():
        assert_near_argmax(reference, ids, outputs[rid], name=rid)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_async_scheduling_gives_the_same_tokens_from_cuda_graphs(dtype):
    """Steps launched ahead on the GPU, fed the step before's tokens on the device and read back
    through pinned memory: in fp32 the same tokens and finish reasons as the engine without it (in
    bf16, tokens an fp32 forward would pick), stops and EOS ending requests while a step is in
    flight, over a pool that preempts."""
    from checkpoint_helpers import llama_tensors

    from fp8route import SamplingParams

    tensors = llama_tensors(CONFIG)
    requests = prompts(8, seed=5)
    free = run(make_engine(dtype, tensors=tensors), requests, SamplingParams(max_tokens=24, temperature=0))
    stop = {rid: out[7] for rid, out in free.items()}
    results = {}
    for ahead in (False, True):
        engine = make_engine(dtype, tensors=tensors, num_blocks=NUM_BLOCKS + 8)
        engine.async_scheduling = ahead
        engine.eos_token_ids = (stop["r1"],)
        finished = {}
        outputs = {}
        pending = list(requests.items())
        while pending or engine.has_unfinished:
            if pending:
                rid, ids = pending.pop(0)
                params = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop[rid]] if rid != "r1" else [])
                engine.add_request(ids, params, request_id=rid)
            for update in engine.step():
                outputs.setdefault(update.request.request_id, []).extend(update.new_token_ids)
                if update.finished:
                    finished[update.request.request_id] = update.request.finish_reason
        assert engine.leaked() is None and (engine.ahead_steps > 0) == ahead
        results[ahead] = (outputs, finished)
    if dtype == torch.float32:
        assert results[True] == results[False]
        assert set(results[False][1].values()) == {"stop"}
    else:  # a request a stop ends still rides its step ahead: other buckets, bf16 near-ties may go either way
        reference = reference_model(tensors)
        for rid, ids in requests.items():
            assert_near_argmax(reference, ids, results[True][0][rid], name=rid)


@pytest.mark.gpu
@gpu
def test_decode_graphs_first_captured_under_inference_mode_serve_steps_outside_it():
    """A caller's first steps under inference_mode capture the graphs; later steps under no_grad
    write the same static inputs, which must be ordinary tensors for that."""
    from checkpoint_helpers import llama_tensors

    from fp8route import SamplingParams

    engine = make_engine(torch.float32, tensors=llama_tensors(CONFIG))
    params = SamplingParams(max_tokens=6, temperature=0)
    with torch.inference_mode():
        first = run(engine, {"a": [1, 2, 3]}, params)
    with torch.no_grad():
        again = run(engine, {"b": [1, 2, 3]}, params)
    assert again["b"] == first["a"]


@gpu
def test_no_cycle_collection_runs_inside_a_capture():
    """A collection inside a capture can reset an earlier model's dead CUDA graphs, which invalidates
    the capture (an H100 test process failed so): with the collector set to run at every allocation,
    none runs while capture_graph captures, and the graph replays what it captured."""
    import gc

    from fp8route.device import capture_graph

    during: list[bool] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            during.append(torch.cuda.is_current_stream_capturing())

    y = torch.ones(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    threshold = gc.get_threshold()
    gc.callbacks.append(record)
    try:
        gc.set_threshold(1, 1, 1)
        with capture_graph(graph):
            for _ in range(64):
                y = y + 1.0
                _ = [[] for _ in range(8)]  # container allocations: each may start a collection
        gc.collect()
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*threshold)
    graph.replay()
    assert during and not any(during), "a collection ran inside the capture"
    assert torch.equal(y.cpu(), torch.full((8,), 65.0))


@gpu
def test_async_llm_streams_on_a_gpu_given_as_plain_cuda(tmp_path):
    """AsyncLLM's engine thread makes the engine's GPU current first: a device given without its index
    too (its thread died at start there, and every stream waited for ever)."""
    import asyncio

    from checkpoint_helpers import text_model_folder

    from fp8route import LLM, SamplingParams
    from fp8route.engine.async_llm import AsyncLLM

    # A pool of a fixed size, not most of a GPU other test processes share.
    llm = LLM(
        text_model_folder(tmp_path / "tiny"), device="cuda", max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64
    )
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ids = llm.encode("hello there, the world")
    offline = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    engine = AsyncLLM(llm)
    try:

        async def stream():
            return [t async for out in engine.generate(ids, params) for t in out.new_token_ids]

        assert asyncio.run(asyncio.wait_for(stream(), timeout=120)) == list(offline)
        assert engine.alive
    finally:
        engine.shutdown()
