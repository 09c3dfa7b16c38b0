"""The paged split-KV decode attention against the SDPA reference (tolerances relative to the
output's scale: dropping one split or one block fails them), through shuffled block tables of
several block sizes, inside a CUDA graph, with the new token fused, and as the attention of the
engine's captured decode step."""

from __future__ import annotations

import pytest
import torch
from helpers import build_lm, paged

from fp8route.engine.attention import decode_attention_torch
from fp8route.kernels import paged_decode as da

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or da.TRITON_IMPORT_ERROR is not None, reason="needs CUDA and triton"
)
CASES = [  # (B, H, Hkv, D, S, lengths, block size)
    (1, 8, 8, 128, 8192, [1], 16),
    (1, 32, 8, 128, 8192, [1100], 16),
    (1, 32, 4, 128, 8192, [8192], 64),
    (2, 8, 1, 64, 4096, [65, 127], 16),
    (3, 32, 8, 128, 2048, [1, 129, 2047], 1),
    (4, 28, 4, 128, 1024, [5, 64, 65, 1000], 32),
    (8, 16, 2, 80, 512, [1, 2, 63, 64, 129, 200, 300, 512], 16),
    (16, 32, 32, 128, 8192, [37 * i + 1 for i in range(16)], 16),
    (5, 64, 8, 128, 32768, [1, 9000, 16385, 32768, 100], 128),
]


def make(b, h, hkv, d, s, lengths, block_size, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, hkv, s, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, hkv, s, d, device="cuda", generator=g).to(dtype)
    k_blocks, tables = paged(k, block_size, seed)
    v_blocks, _ = paged(v, block_size, seed)
    rows = torch.arange(b, device="cuda")
    return q, k, v, da.Pages(k_blocks, v_blocks, tables, rows), torch.tensor(lengths, device="cuda")


def reference(q, k, v, lengths):
    return decode_attention_torch(q.float(), k.float(), v.float(), lengths)


def assert_close_relative(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-2) -> None:
    """Frobenius error under rel of the reference's norm, the worst element under 2 * rel of its largest."""
    out, ref = out.float(), ref.float()
    assert not out.isnan().any()
    assert ((out - ref).norm() / ref.norm()).item() < rel
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 2 * rel


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-H{c[1]}-kv{c[2]}-D{c[3]}-S{c[4]}-page{c[6]}")
def test_matches_sdpa_reference_through_shuffled_blocks(case, dtype):
    q, k, v, pages, lengths = make(*case, dtype)
    out = da.decode_attention(q, pages, lengths)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close_relative(out, reference(q, k, v, lengths))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("launch", ["64x4x3hg-r128", "64x4x3g", "64x4x4hg-r128"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16 cache", "fp8 cache"])
@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[8]], ids=["page16", "page1", "page128"])
def test_a_launch_reading_its_tables_once_matches_the_reference(launch, fp8, case):
    """Launch.table ("g": a split's block-table entries loaded once, each tile's gathered from them),
    with and without fp16 tiles and a register cap, over pages of 1, 16 and 128 positions."""
    q, k, v, pages, lengths = make(*case, torch.bfloat16)
    if fp8:  # the cache as e4m3 at scale 1 (randn values are within its range); the reference reads the same values
        pages = pages._replace(k=pages.k.to(torch.float8_e4m3fn), v=pages.v.to(torch.float8_e4m3fn))
        k, v = k.to(torch.float8_e4m3fn).to(torch.bfloat16), v.to(torch.float8_e4m3fn).to(torch.bfloat16)
    out = da.decode_attention(q, pages, lengths, launch=da.Launch.parse(launch))
    assert_close_relative(out, reference(q, k, v, lengths))


@pytest.mark.gpu
@gpu
def test_a_dropped_block_fails_the_tolerance():
    """The check above can fail: zero one block of one row and it does."""
    q, k, v, pages, lengths = make(2, 32, 8, 128, 2048, [2000, 1500], 16, torch.bfloat16)
    k2 = k.clone()
    k2[0, :, 512:528] = 0
    with pytest.raises(AssertionError):
        assert_close_relative(da.decode_attention(q, pages, lengths), reference(q, k2, v, lengths))


@pytest.mark.gpu
@gpu
def test_reads_nothing_past_each_rows_length_nor_other_rows_blocks():
    q, k, v, pages, lengths = make(3, 32, 8, 128, 4096, [1, 700, 4000], 16, torch.bfloat16)
    out = da.decode_attention(q, pages, lengths)
    used = set()
    for b, n in enumerate(lengths.tolist()):
        used |= set(pages.tables[b, : -(-n // 16)].tolist())
    unused = [i for i in range(pages.k.shape[0]) if i not in used]
    pages.k[unused], pages.v[unused] = float("nan"), float("nan")
    for b, n in enumerate(lengths.tolist()):  # the rest of each row's last block too
        last = pages.tables[b, (n - 1) // 16].item()
        pages.k[last, n % 16 or 16 :], pages.v[last, n % 16 or 16 :] = float("nan"), float("nan")
    assert torch.equal(da.decode_attention(q, pages, lengths), out)


@pytest.mark.gpu
@gpu
def test_replays_in_a_cuda_graph_with_new_lengths_and_rows():
    q, k, v, pages, lengths = make(4, 32, 8, 128, 8192, [1, 100, 1100, 5000], 16, torch.bfloat16)
    da.decode_attention(q, pages, lengths)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = da.decode_attention(q, pages, lengths)
    for new, rows in (
        ([1, 1, 1, 1], [0, 1, 2, 3]),
        ([8192, 3, 4097, 129], [3, 2, 1, 0]),
        ([63, 64, 65, 66], [1, 1, 0, 0]),
    ):
        lengths.copy_(torch.tensor(new))
        pages.rows.copy_(torch.tensor(rows))
        graph.replay()
        index = torch.tensor(rows, device="cuda")
        assert_close_relative(out, reference(q, k[index], v[index], lengths))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("b", "h", "hkv", "d", "s", "positions", "page"), [
    (1, 32, 8, 128, 8192, [1099], 16),
    (3, 32, 8, 128, 2048, [0, 128, 2047], 16),
    (4, 16, 2, 64, 1024, [5, 63, 64, 1000], 8),
    (4, 32, 2, 128, 1024, [127, 128, 255, 256], 32),  # either side of a split's start (128 positions each)
])  # fmt: skip
def test_new_token_fused_is_rope_and_the_cache_write_then_attention(b, h, hkv, d, s, positions, page):
    from fp8route.kernels.fused import rope, rope_into_cache
    from fp8route.models.llama import LlamaConfig, rope_tables

    g = torch.Generator(device="cuda").manual_seed(3)
    width = (h + 2 * hkv) * d
    qkv = torch.randn(b, 1, width, device="cuda", generator=g).to(torch.bfloat16)  # as the GEMM gives it
    q, k, v = (t.reshape(b, 1, -1, d) for t in qkv.split([h * d, hkv * d, hkv * d], dim=-1))
    pos = torch.tensor(positions, device="cuda")
    cfg = LlamaConfig(h * d, 4 * h * d, h, hkv, 1, 32, rope_theta=500000.0, head_dim=d)
    cos, sin = (t[:, None] for t in rope_tables(cfg, pos))  # [B, 1, D] fp32, as the engine gathers them
    dense = [torch.randn(b, hkv, s, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]
    (k_blocks, tables), (v_blocks, _) = paged(dense[0], page), paged(dense[1], page)
    rows = torch.arange(b, device="cuda")
    fused = da.Pages(k_blocks.clone(), v_blocks.clone(), tables, rows)
    new = da.NewToken(k[:, 0], v[:, 0], cos[:, 0], sin[:, 0])
    assert da.fuses_new_token(q[:, 0], new)
    out = da.decode_attention(q[:, 0], fused, pos + 1, new=new)
    ref = da.Pages(k_blocks.clone(), v_blocks.clone(), tables, rows)
    slots = tables[rows, pos // page].long() * page + pos % page
    rope_into_cache(k, v, cos, sin, ref.k.view(-1, hkv, d), ref.v.view(-1, hkv, d), slots)
    expected = da.decode_attention(rope(q, cos, sin)[:, :, 0].contiguous(), ref, pos + 1)
    assert_close_relative(out, expected)
    torch.testing.assert_close(fused.k, ref.k, equal_nan=True)  # the rotated key: the same sums, maybe fused apart
    assert torch.equal(fused.v.nan_to_num(), ref.v.nan_to_num())
    written = ref.k.view(-1, hkv, d)[slots]
    assert not written.isnan().any()  # each row's new position, and nothing else, changed
    fused.k.view(-1, hkv, d)[slots] = written
    assert torch.equal(fused.k.nan_to_num(), ref.k.nan_to_num())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_engine_graphs_and_triton_match_eager_torch_decode(kv_heads):
    from checkpoint_helpers import TINY, llama_tensors
    from helpers import generate_with_logits

    from fp8route.engine import CausalLM, EngineConfig
    from fp8route.models import LlamaConfig

    config = {**TINY, "num_key_value_heads": kv_heads, "hidden_size": 256, "num_attention_heads": 4}
    tensors = {n: t.float().cuda() for n, t in llama_tensors(config).items()}
    cfg = LlamaConfig.from_hf(config)
    ids = torch.randint(
        0, config["vocab_size"], (3, 20), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    lengths = [20, 7, 13]

    def model(graphs: bool) -> CausalLM:
        settings = EngineConfig(
            dtype="float32", max_num_seqs=4, max_model_len=256, use_cuda_graphs=graphs, num_kv_blocks=128
        )
        return build_lm(cfg, {}, tensors, settings)

    results = {}
    for graphs in (True, False):
        lm = model(graphs)
        results[graphs] = generate_with_logits(lm, ids, 24, prompt_lengths=lengths)
        assert (lm.engine.runner.graphs is not None) == graphs
    torch.testing.assert_close(results[True][1], results[False][1], rtol=1e-3, atol=1e-3)
    # The reference: eager torch attention, no Triton, no graphs.
    lm = model(False)
    lm.engine.runner.use_triton = False
    tokens, logits = generate_with_logits(lm, ids, 24, prompt_lengths=lengths)
    torch.testing.assert_close(results[True][1], logits, rtol=1e-3, atol=1e-3)
    assert torch.equal(results[True][0], tokens)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("programs", [1, 5, None])
def test_programs_running_several_splits_each_give_one_per_splits_bits(fp8, programs):
    """Fewer programs than splits (issue 47's grid sized by the batch, not the table; None: the
    default's programs_for): the same bits as one program per split."""
    q, _, _, pages, lengths = make(5, 64, 8, 128, 32768, [1, 9000, 16385, 32768, 100], 128, torch.bfloat16)
    if fp8:
        pages = pages._replace(k=pages.k.to(torch.float8_e4m3fn), v=pages.v.to(torch.float8_e4m3fn), k_scale=0.5)
    splits = min(64, -(-pages.max_len // da.split_len(5 * 8)))
    one_per_split = da.decode_attention(q, pages, lengths, programs=splits)
    assert torch.equal(da.decode_attention(q, pages, lengths, programs=programs), one_per_split)
