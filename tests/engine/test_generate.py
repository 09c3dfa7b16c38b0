"""The static generate on CPU, run as requests of the model's engine: cached decode equals the full
forward, batches equal single rows (a batch larger than the engine runs at once too), chunked prefill
equals one forward, EOS, bad input refused before any work, determinism, the same tokens as
LLM.generate for the same seed, and load_model on FP8 and bf16 checkpoints."""

import numpy as np
import pytest
import torch
from checkpoint_helpers import TINY, llama_tensors, modelopt_folder, write_checkpoint
from helpers import build_lm, greedy_continuation

from fp8route import Fp8InputError, load_checkpoint
from fp8route.engine import EngineConfig, SamplingParams, load_model
from fp8route.engine.attention import decode_attention_torch
from fp8route.engine.decode_graphs import buckets, padded_inputs
from fp8route.engine.sampling import MAX_TEMPERATURE
from fp8route.loading import model_from_checkpoint
from fp8route.models import LlamaConfig, LlamaForCausalLM

CFG = LlamaConfig.from_hf(TINY)
VOCAB = TINY["vocab_size"]


def tiny(max_num_seqs=4, max_model_len=64, dtype=torch.float32, tensors=None, **settings):
    tensors = {k: v.to(dtype) for k, v in (tensors or llama_tensors()).items()}
    config = EngineConfig(dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len, **settings)
    return build_lm(CFG, {}, tensors, config)


def prompts(batch, length, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return tiny()


def test_generate_equals_stepwise_argmax_of_the_full_forward(model):
    ids = prompts(2, 7)
    tokens = model.generate(ids, 6)
    assert tokens.shape == (2, 13) and tokens.dtype == torch.int64 and torch.equal(tokens[:, :7], ids)
    assert torch.equal(tokens, greedy_continuation(model, ids, 6))
    assert model.engine.leaked() is None


def test_full_forward_keeps_the_reference_numerics(model):
    ids = prompts(2, 12)
    with torch.no_grad():
        reference = LlamaForCausalLM(CFG, {}, {k: v.float() for k, v in llama_tensors().items()})(ids)
        assert torch.equal(model(ids), reference)


def test_rows_of_different_lengths_match_running_each_alone(model):
    lengths = [3, 9, 5]
    ids = prompts(3, 9, seed=2)
    batched = model.generate(ids, 5, prompt_lengths=lengths, pad_token_id=0)
    for row, n in enumerate(lengths):
        alone = model.generate(ids[row : row + 1, :n], 5)
        assert torch.equal(batched[row, : n + 5], alone[0]), row
        assert torch.all(batched[row, n + 5 :] == 0)


def test_decode_reads_only_each_rows_filled_positions():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 16, generator=g)
    k, v = torch.randn(2, 3, 2, 40, 16, generator=g)
    lengths = torch.tensor([1, 17, 40])
    out = decode_attention_torch(q, k, v, lengths)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    for b, n in enumerate(lengths.tolist()):
        poisoned_k[b, :, n:], poisoned_v[b, :, n:] = 1e4, -1e4
    torch.testing.assert_close(decode_attention_torch(q, poisoned_k, poisoned_v, lengths), out)
    for b, n in enumerate(lengths.tolist()):
        for h in range(4):
            kk, vv = k[b, h // 2, :n], v[b, h // 2, :n]
            ref = torch.softmax(q[b, h] @ kk.T / 4, -1) @ vv
            torch.testing.assert_close(out[b, h], ref, rtol=1e-5, atol=1e-5)


def test_eos_stops_a_row_and_then_the_call(model):
    ids = prompts(2, 5, seed=4)
    free = model.generate(ids, 8)
    eos = int(free[0, 5 + 2])  # row 0's third new token
    steps = []
    out = model.generate(ids, 8, eos_token_id=[eos], on_token=lambda step, tokens: steps.append(tokens.clone()))
    first = next(i for i in range(8) if int(free[0, 5 + i]) == eos)
    assert torch.equal(out[0, : 5 + first + 1], free[0, : 5 + first + 1])
    assert torch.all(out[0, 5 + first + 1 :] == eos)  # pad defaults to the EOS id
    row1 = [i for i in range(8) if int(free[1, 5 + i]) == eos]
    assert len(steps) == (max(first, row1[0]) + 1 if row1 else 8)
    # Both rows stopping ends the call early: feed each row's own first token as its EOS.
    both = [int(free[0, 5]), int(free[1, 5])]
    steps.clear()
    out = model.generate(ids, 8, eos_token_id=both, on_token=lambda step, tokens: steps.append(step))
    assert steps == [0] and torch.all(out[:, 6:] == both[0])


def test_more_rows_than_the_engine_runs_at_once_queue_and_equal_each_alone(model):
    ids = prompts(9, 5, seed=21)  # max_num_seqs is 4
    out = model.generate(ids, 4)
    assert torch.equal(out, greedy_continuation(model, ids, 4))


def test_bad_input_is_refused_before_any_work(model, monkeypatch):
    def no_step(*args, **kwargs):
        raise AssertionError("a step ran")

    monkeypatch.setattr(model.engine.runner, "forward", no_step)
    with pytest.raises(Fp8InputError, match=r"row 0: a prompt of 60 tokens \+ max_tokens=5 = 65 exceeds the model's"):
        model.generate(prompts(1, 60), 5)
    with pytest.raises(Fp8InputError, match="prompt_lengths must give each of the 2 rows a length in 1..4"):
        model.generate(prompts(2, 4), 2, prompt_lengths=[4, 5])
    with pytest.raises(Fp8InputError, match=f"token ids must be in 0..{VOCAB - 1}"):
        model.generate(torch.tensor([[1, VOCAB]]), 2)
    for bad in ({"temperature": float("nan")}, {"temperature": -1}, {"top_p": 0}):
        with pytest.raises(Fp8InputError, match="SamplingParams: "):
            model.generate(prompts(1, 4), 2, **bad)
    assert not model.engine.has_unfinished


def test_the_same_seed_gives_the_same_tokens_through_generate_and_the_engines_requests(model):
    ids = prompts(3, 6, seed=17)
    out = model.generate(ids, 6, temperature=1.3, top_p=0.95, seed=5)
    engine = model.engine
    params = SamplingParams(max_tokens=6, temperature=1.3, top_p=0.95, seed=5, ignore_eos=True)
    requests = [engine.add_request(row.tolist(), params) for row in ids]
    while engine.has_unfinished:
        engine.step()
    assert [r.output_token_ids for r in requests] == out[:, 6:].tolist()


def test_greedy_and_seeded_sampling_are_deterministic(model):
    ids = prompts(3, 6, seed=5)
    assert torch.equal(model.generate(ids, 6), model.generate(ids, 6))
    a = model.generate(ids, 6, temperature=1.0, top_p=0.9, seed=11)
    b = model.generate(ids, 6, temperature=1.0, top_p=0.9, seed=11)
    assert torch.equal(a, b)
    hot = model.generate(ids, 6, temperature=MAX_TEMPERATURE, seed=12)
    assert not torch.equal(hot, model.generate(ids, 6))  # the flattest distribution allowed leaves greedy's path
    # top_p this small keeps only the most likely token: greedy again.
    assert torch.equal(model.generate(ids, 6, temperature=1.0, top_p=1e-6, seed=13), model.generate(ids, 6))


def test_bf16_engine_tracks_its_full_forward():
    model = tiny(dtype=torch.bfloat16)
    ids = prompts(2, 8, seed=6)
    tokens = model.generate(ids, 4)
    assert model.engine.runner.pool.k.dtype == torch.bfloat16
    with torch.no_grad():
        full = model(tokens[:, :-1]).float()[:, 7:]
    # Each token the engine chose is the full forward's argmax, or within bf16's rounding of it.
    chosen = full.gather(-1, tokens[:, 8:, None])[..., 0]
    assert torch.all(chosen >= full.max(-1).values - 0.02 * full.abs().max())


def test_buckets():
    assert buckets(16) == [1, 2, 4, 8, 16] and buckets(12) == [1, 2, 4, 8, 12] and buckets(1) == [1]
    assert buckets(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100] and buckets(64) == [1, 2, 4, 8, 16, 32, 64]


def test_a_decode_graphs_inputs_are_padded_on_the_host_to_the_scratch_row_and_an_even_width():
    host = np.array([[5, 0, 7], [0, 1, 0], [10, 3, 4], [2, 0, 1]], dtype=np.int64)  # ids, pending, positions, rows
    padded = padded_inputs(host, 4, pad_row=9)
    assert padded.shape == (4, 4) and (padded[:, :3] == host).all()
    assert padded[:, 3].tolist() == [0, 0, 0, 9]  # token 0 from the host at position 0 of the padding row
    single = padded_inputs(host[:, :1], 1, pad_row=9)
    assert single.shape == (4, 2) and single[:, 0].tolist() == [5, 0, 10, 2]  # 16-byte rows for Triton
    assert padded_inputs(host, 3, pad_row=9).shape == (4, 4)


def test_a_bucket_keeps_pdl_only_when_it_measured_faster_by_more_than_the_margin():
    from fp8route.engine.decode_graphs import PDL_MARGIN, PdlChoice

    assert PdlChoice(3.0, 3.0 * (1 - 2 * PDL_MARGIN)).pdl
    assert not PdlChoice(3.0, 3.0 * (1 - PDL_MARGIN / 2)).pdl  # within the margin: the plain launches
    assert not PdlChoice(3.0, 3.1).pdl
    assert str(PdlChoice(3.0, 2.9)) == "PDL on (2.900 ms a replay with it, 3.000 without)"


def test_chunked_prefill_and_small_blocks_give_the_same_tokens_and_logits():
    """Prompts split over forwards of 5 tokens (later chunks attend to their earlier blocks through
    the table) against whole-prompt prefill, with 4-token blocks against 16."""
    whole = tiny()
    chunked = tiny(max_num_batched_tokens=5, block_size=4)
    ids = prompts(3, 19, seed=14)
    lengths = [19, 7, 12]
    a = whole.generate(ids, 8, prompt_lengths=lengths)
    b = chunked.generate(ids, 8, prompt_lengths=lengths)
    assert torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(whole(ids), chunked(ids))  # the full forward in groups of rows: the same
    assert whole.engine.leaked() is None and chunked.engine.leaked() is None


def test_load_model_fp8_checkpoint_equals_the_llama_forward(tmp_path):
    folder = modelopt_folder(tmp_path)
    model = load_model(folder, device="cpu", dtype="float32", max_num_seqs=2, max_model_len=32)
    assert model.max_model_len == 32
    reference = model_from_checkpoint(load_checkpoint(folder, device="cpu"))
    ids = prompts(2, 10, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids, dtype=torch.float32), rtol=1e-5, atol=1e-5)
    qkv = model.module.model.layers[0].self_attn.qkv_proj
    assert type(qkv).__name__ == "Fp8Linear" and qkv.weight.dtype == torch.float8_e4m3fn
    out = model.generate(ids, 3)
    assert out.shape == (2, 13)


def test_load_model_bf16_checkpoint_and_max_position_embeddings(tmp_path):
    tensors = llama_tensors()
    folder = write_checkpoint(tmp_path / "bf16", tensors, {**TINY, "max_position_embeddings": 48})
    model = load_model(folder, device="cpu", max_num_seqs=2)
    assert model.max_model_len == 48 and model.module.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = prompts(2, 10, seed=8)
    with torch.no_grad():
        assert torch.equal(model(ids), LlamaForCausalLM(CFG, {}, tensors)(ids))
    fp32 = load_model(folder, device="cpu", dtype=torch.float32, max_model_len=16)
    assert fp32.max_model_len == 16 and fp32.engine.runner.pool.k.dtype == torch.float32
    with pytest.raises(Fp8InputError, match="^dtype must be one of bfloat16, float16, float32, got 'torch.int8'$"):
        load_model(folder, device="cpu", dtype=torch.int8)


def test_qwen_style_biases_and_head_norms_decode_like_the_full_forward():
    """Qwen2's q/k/v biases and Qwen3's per-head q/k norms sit before RoPE and the cache write."""
    tensors = {k: v.float() for k, v in llama_tensors().items()}
    g = torch.Generator().manual_seed(9)
    head = TINY["hidden_size"] // TINY["num_attention_heads"]
    for i in range(TINY["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn"
        for m in ("q", "k", "v"):
            tensors[f"{p}.{m}_proj.bias"] = 0.1 * torch.randn(tensors[f"{p}.{m}_proj.weight"].shape[0], generator=g)
        for m in ("q", "k"):
            tensors[f"{p}.{m}_norm.weight"] = 1 + 0.1 * torch.randn(head, generator=g)
    model = tiny(tensors=tensors)
    assert model.module.model.layers[0].self_attn.q_norm is not None
    ids = prompts(2, 6, seed=10)
    assert torch.equal(model.generate(ids, 4), greedy_continuation(model, ids, 4))


def test_an_nn_module_method_on_the_handle_names_where_it_is(model):
    with pytest.raises(AttributeError, match=r"not an nn.Module: 'parameters' is the plain model's, model.module"):
        model.parameters()
    assert sum(p.numel() for p in model.module.parameters()) > 0
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        model.no_such_thing  # noqa: B018
