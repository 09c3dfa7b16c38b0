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


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("b", "h", "hkv", "d", "s", "positions"), [
    (1, 32, 8, 128, 8192, [1099]),
    (3, 32, 8, 128, 2048, [0, 128, 2047]),
    (4, 16, 2, 64, 1024, [5, 63, 64, 1000]),
    (4, 32, 2, 128, 1024, [127, 128, 255, 256]),  # either side of a split's start (128 positions each)
])  # fmt: skip
def test_new_token_fused_is_rope_and_the_cache_write_then_attention(b, h, hkv, d, s, positions):
    from fp8route.models.fused import rope, rope_into_cache
    from fp8route.models.llama import LlamaConfig, rope_tables

    g = torch.Generator(device="cuda").manual_seed(3)
    width = (h + 2 * hkv) * d
    qkv = torch.randn(b, 1, width, device="cuda", generator=g).to(torch.bfloat16)  # as the GEMM gives it
    q, k, v = (t.reshape(b, 1, -1, d) for t in qkv.split([h * d, hkv * d, hkv * d], dim=-1))
    pos = torch.tensor(positions, device="cuda")
    cfg = LlamaConfig(h * d, 4 * h * d, h, hkv, 1, 32, rope_theta=500000.0, head_dim=d)
    cos, sin = (t[:, None] for t in rope_tables(cfg, pos))  # [B, 1, D] fp32, as the engine gathers them
    caches = [torch.randn(b + 2, hkv, s, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]
    fused_k, fused_v = (c.clone() for c in caches)
    new = da.NewToken(k[:, 0], v[:, 0], cos[:, 0], sin[:, 0])
    assert da.fuses_new_token(q[:, 0], new)
    out = da.decode_attention(q[:, 0], fused_k, fused_v, pos + 1, new=new)
    ref_k, ref_v = (c.clone() for c in caches)
    rope_into_cache(k, v, cos, sin, ref_k, ref_v, pos)
    expected = da.decode_attention(rope(q, cos, sin)[:, :, 0].contiguous(), ref_k, ref_v, pos + 1)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fused_k, ref_k)  # the rotated key: the same sums, maybe fused apart
    assert torch.equal(fused_v, ref_v)
    rows = torch.arange(b, device="cuda")
    fused_k[rows, :, pos] = ref_k[rows, :, pos]
    assert torch.equal(fused_k, ref_k)  # nothing written but each row's new position
