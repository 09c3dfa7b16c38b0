"""The Triton split-KV decode attention against the SDPA reference, alone, inside a CUDA graph,
and as the attention of the engine's captured decode step."""

from __future__ import annotations

import pytest
import torch

from fp8route.models import decode_attention as da
from fp8route.models.attention import decode_attention_torch

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or da.TRITON_IMPORT_ERROR is not None, reason="needs CUDA and triton"
)
CASES = [  # (B, H, Hkv, D, S, lengths)
    (1, 8, 8, 128, 8192, [1]),
    (1, 32, 8, 128, 8192, [1100]),
    (1, 32, 4, 128, 8192, [8192]),
    (2, 8, 1, 64, 4096, [65, 127]),
    (3, 32, 8, 128, 2048, [1, 129, 2047]),
    (4, 28, 4, 128, 1024, [5, 64, 65, 1000]),
    (8, 16, 2, 80, 512, [1, 2, 63, 64, 129, 200, 300, 512]),
    (16, 32, 32, 128, 8192, [37 * i + 1 for i in range(16)]),
    (5, 64, 8, 128, 32768, [1, 9000, 16385, 32768, 100]),
]


def make(b, h, hkv, d, s, lengths, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, d, device="cuda", generator=g).to(dtype)
    # Two spare cache rows, as the model's cache holds max_batch_size rows and a batch uses a prefix.
    k = torch.randn(b + 2, hkv, s, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(b + 2, hkv, s, d, device="cuda", generator=g).to(dtype)
    return q, k, v, torch.tensor(lengths, device="cuda")


def reference(q, k, v, lengths):
    return decode_attention_torch(q.float(), k.float(), v.float(), lengths)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-H{c[1]}-kv{c[2]}-D{c[3]}-S{c[4]}")
def test_matches_sdpa_reference(case, dtype):
    q, k, v, lengths = make(*case, dtype)
    out = da.decode_attention(q, k[: q.shape[0]], v[: q.shape[0]], lengths)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), reference(q, k, v, lengths), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@gpu
def test_reads_nothing_past_each_rows_length():
    q, k, v, lengths = make(3, 32, 8, 128, 4096, [1, 700, 4000], torch.bfloat16)
    out = da.decode_attention(q, k, v, lengths)
    for b, n in enumerate(lengths.tolist()):
        k[b, :, n:], v[b, :, n:] = float("nan"), float("nan")
    assert torch.equal(da.decode_attention(q, k, v, lengths), out)


@pytest.mark.gpu
@gpu
def test_replays_in_a_cuda_graph_with_new_lengths():
    q, k, v, lengths = make(4, 32, 8, 128, 8192, [1, 100, 1100, 5000], torch.bfloat16)
    da.decode_attention(q, k, v, lengths)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = da.decode_attention(q, k, v, lengths)
    for new in ([1, 1, 1, 1], [8192, 3, 4097, 129], [63, 64, 65, 66]):
        lengths.copy_(torch.tensor(new))
        graph.replay()
        torch.testing.assert_close(out.float(), reference(q, k, v, lengths), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_engine_graphs_and_triton_match_eager_torch_decode(kv_heads):
    from checkpoint_helpers import TINY, llama_tensors

    from fp8route.models import CausalLM, LlamaConfig

    config = {**TINY, "num_key_value_heads": kv_heads, "hidden_size": 256, "num_attention_heads": 4}
    tensors = {n: t.float().cuda() for n, t in llama_tensors(config).items()}
    cfg = LlamaConfig.from_hf(config)
    ids = torch.randint(
        0, config["vocab_size"], (3, 20), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    lengths = [20, 7, 13]
    results = {}
    for graphs in (True, False):
        model = CausalLM(
            cfg, {}, tensors, max_batch_size=4, max_seq_len=256, dtype=torch.float32, use_cuda_graphs=graphs
        )
        results[graphs] = model.generate(ids, 24, prompt_lengths=lengths, return_logits=True)
        assert (model._graphs is not None) == graphs
    torch.testing.assert_close(results[True].logits, results[False].logits, rtol=1e-3, atol=1e-3)
    # The reference: eager torch attention, no Triton, no graphs.
    model = CausalLM(cfg, {}, tensors, max_batch_size=4, max_seq_len=256, dtype=torch.float32, use_cuda_graphs=False)
    model.use_triton = False
    reference = model.generate(ids, 24, prompt_lengths=lengths, return_logits=True)
    torch.testing.assert_close(results[True].logits, reference.logits, rtol=1e-3, atol=1e-3)
    assert torch.equal(results[True].tokens, reference.tokens)
