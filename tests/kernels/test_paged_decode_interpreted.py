"""The paged split-KV decode kernel over a 16-bit cache, run by Triton's interpreter on a CPU
(TRITON_INTERPRET=1, with the triton extra) against the SDPA reference: shuffled blocks of several
sizes, split lengths that grow with a row's length, and the fused new token (RoPE and the cache
write inside the kernel). fp32 tensors: the interpreter has no bfloat16. On a GPU,
tests/kernels/test_paged_decode_gpu.py covers the same kernel."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import paged

from fp8route.engine.attention import decode_attention_torch
from fp8route.errors import Fp8InputError
from fp8route.kernels import paged_decode as da
from fp8route.kernels.fused import rope, rope_into_cache
from fp8route.models.llama import LlamaConfig, rope_tables

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1" or da.TRITON_IMPORT_ERROR is not None or torch.cuda.is_available(),
        reason="Triton's interpreter on a CPU: needs triton and TRITON_INTERPRET=1 (on a GPU, its _gpu test covers it)",
    ),
]


def relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize(
    ("b", "h", "hkv", "d", "s", "lengths", "page", "split"),
    [
        (1, 4, 2, 32, 512, [200], 16, None),
        (2, 4, 1, 32, 1024, [1, 1000], 8, 64),  # 16 splits at most: the long row takes longer ones
        (3, 8, 2, 16, 256, [64, 65, 256], 16, 64),
        (1, 2, 1, 16, 4096, [4000], 32, 64),
        (4, 16, 8, 16, 1024, [1, 100, 700, 1024], 16, None),  # 32 pairs: short rows cut into 8 splits or fewer
    ],
)
def test_the_kernel_is_sdpa_over_each_rows_positions(b, h, hkv, d, s, lengths, page, split):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, d, generator=g)
    k, v = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    (k_blocks, tables), (v_blocks, _) = paged(k, page), paged(v, page)
    n = torch.tensor(lengths)
    out = da.decode_attention(q, da.Pages(k_blocks, v_blocks, tables, torch.arange(b)), n, split=split)
    assert relative(out, decode_attention_torch(q, k, v, n)) < 1e-4  # one dropped tile is ~1e-2


def test_the_fused_new_token_is_rope_and_the_cache_write_then_attention():
    b, h, hkv, d, s, page = 3, 4, 2, 32, 512, 16
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(b, 1, (h + 2 * hkv) * d, generator=g)
    q, k, v = (t.reshape(b, 1, -1, d) for t in qkv.split([h * d, hkv * d, hkv * d], dim=-1))
    pos = torch.tensor([0, 130, 511])
    cos, sin = (t[:, None] for t in rope_tables(LlamaConfig(h * d, 4 * h * d, h, hkv, 1, 32, head_dim=d), pos))
    (k_blocks, tables), (v_blocks, _) = (paged(torch.randn(b, hkv, s, d, generator=g), page) for _ in range(2))
    rows = torch.arange(b)
    fused = da.Pages(k_blocks.clone(), v_blocks.clone(), tables, rows)
    out = da.decode_attention(q[:, 0], fused, pos + 1, new=da.NewToken(k[:, 0], v[:, 0], cos[:, 0], sin[:, 0]))
    ref = da.Pages(k_blocks.clone(), v_blocks.clone(), tables, rows)
    slots = tables[rows, pos // page].long() * page + pos % page
    rope_into_cache(k, v, cos, sin, ref.k.view(-1, hkv, d), ref.v.view(-1, hkv, d), slots)
    gathered = [x[tables[rows].long()].flatten(1, 2).transpose(1, 2) for x in (ref.k, ref.v)]
    assert relative(out, decode_attention_torch(rope(q, cos, sin)[:, :, 0], *gathered, pos + 1)) < 1e-4
    assert torch.allclose(fused.k.nan_to_num(), ref.k.nan_to_num(), atol=1e-5)  # the same key written
    assert torch.equal(fused.v.nan_to_num(), ref.v.nan_to_num())


def test_a_small_batchs_short_rows_take_shorter_splits():
    """target_splits: about 256 programs over up to 32 (row, KV head) pairs, none above; for the register-capped
    launch (four programs a SM) about 512 over up to 256 pairs."""
    assert [da.target_splits(p, da.Launch()) for p in (2, 8, 16, 32, 40, 512)] == [64, 32, 16, 8, 0, 0]
    capped = da.LAUNCH[True]
    assert [da.target_splits(p, capped) for p in (2, 8, 32, 128, 256, 257, 512)] == [64, 64, 16, 4, 2, 0, 0]


def test_with_a_fixed_split_a_rows_output_does_not_depend_on_its_batch():
    """What a deterministic mode on a GPU needs of this kernel (issue 49): the default split comes from
    the batch's (row, KV head) pairs, so a long row's partial sums change with the batch; a split fixed
    by the caller makes each row's splits a function of its own length alone, and its bits the same
    alone and batched."""
    assert da.split_len(1 * 8) != da.split_len(64 * 8)
    h, hkv, d, s, page = 4, 2, 32, 1024, 16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(5, h, d, generator=g)
    k, v = torch.randn(5, hkv, s, d, generator=g), torch.randn(5, hkv, s, d, generator=g)
    (k_blocks, tables), (v_blocks, _) = paged(k, page), paged(v, page)
    lengths = torch.tensor([900, 17, 1024, 300, 64])
    batch = da.decode_attention(q, da.Pages(k_blocks, v_blocks, tables, torch.arange(5)), lengths, split=128)
    for b in range(5):
        pages = da.Pages(k_blocks, v_blocks, tables, torch.tensor([b]))
        alone = da.decode_attention(q[b : b + 1], pages, lengths[b : b + 1], split=128)
        assert torch.equal(alone[0], batch[b]), b


def three_rows_and_their_new_tokens(heads: int, seed: int):  # type: ignore[no-untyped-def]
    """q, the new tokens, lengths 1000, 1 and 333, and K/V blocks of 16 positions over 1024 (2 KV heads
    of 32), with their tables: (q, new, lengths, k_blocks, v_blocks, tables)."""
    b, hkv, d, s = 3, 2, 32, 1024
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, d, generator=g)
    k, v = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    new = da.NewToken(*(torch.randn(b, hkv, d, generator=g) for _ in range(2)), *torch.randn(2, b, d, generator=g))
    (k_blocks, tables), (v_blocks, v_tables) = paged(k, 16), paged(v, 16)
    assert torch.equal(tables, v_tables)
    return q, new, torch.tensor([1000, 1, 333]), k_blocks, v_blocks, tables


@pytest.mark.parametrize("programs", [1, 3, 8])
def test_programs_that_each_run_several_splits_give_the_same_bits(programs):
    """With fewer programs than splits each runs every programs-th split of its row (issue 47: a grid
    that need not grow with the table's width): the same splits, the same partial sums, the same bits;
    the fused new token too, written by the program one of whose splits holds it."""
    q, new, lengths, k_blocks, v_blocks, tables = three_rows_and_their_new_tokens(heads=4, seed=7)
    b = len(lengths)
    outs = {}
    for each in (16, programs):  # 16: one program per split of the table's 1024 positions
        pages = da.Pages(k_blocks.clone(), v_blocks.clone(), tables, torch.arange(b))
        outs[each] = (da.decode_attention(q, pages, lengths, split=64, new=new, programs=each), pages.k, pages.v)
    pairs = zip(outs[16], outs[programs], strict=True)
    same = [torch.allclose(x, y, rtol=0, atol=0, equal_nan=True) for x, y in pairs]
    assert same == [True, True, True]  # the output, and the new key and value written (block 0 holds NaN)
    with pytest.raises(Fp8InputError, match="programs 17 must be 1 to a row's splits here, 16"):
        da.decode_attention(q, pages, lengths, split=64, programs=17)


def test_the_default_programs_follow_the_batch_not_the_tables_width():
    sms = 132
    assert da.programs_for(8, 64, sms) == 64  # one row: a program per split, as many as the table allows
    assert da.programs_for(16 * 8, 64, sms) == 5  # batch 16: four waves' worth, each program 13 splits
    assert da.programs_for(256 * 8, 64, sms) == 1
    assert da.programs_for(16 * 8, 2, sms) == 2  # never more than the splits


@pytest.mark.parametrize(
    ("cache_dtype", "page", "split", "fused"),
    [
        (torch.float32, 16, None, False),
        (torch.float32, 32, 64, True),
        (torch.float8_e4m3fn, 128, None, False),  # splits of 64 positions start inside a page
        (torch.float8_e4m3fn, 16, 64, True),
    ],
)
def test_a_launch_that_reads_its_splits_table_entries_once_gives_the_same_bits(cache_dtype, page, split, fused):
    """Launch.table ("g"): a split's block-table entries loaded once and each tile's gathered from them,
    instead of a load per tile: the same blocks read, so the same bits, the fused new token's write too."""
    b, h, hkv, d, s = 3, 4, 2, 32, 1024
    g = torch.Generator().manual_seed(11)
    q = torch.randn(b, h, d, generator=g)
    (k_blocks, tables), (v_blocks, _) = (paged(torch.randn(b, hkv, s, d, generator=g), page) for _ in range(2))
    k_blocks, v_blocks = k_blocks.to(cache_dtype), v_blocks.to(cache_dtype)
    new = da.NewToken(*(torch.randn(b, hkv, d, generator=g) for _ in range(2)), *torch.randn(2, b, d, generator=g))
    lengths = torch.tensor([1000, 1, 333])
    outs = []
    for launch in (da.Launch(64, 4, 3, f16=True, regs=128), da.Launch.parse("64x4x3hg-r128")):
        pages = da.Pages(k_blocks.clone(), v_blocks.clone(), tables, torch.arange(b))
        out = da.decode_attention(q, pages, lengths, split=split, new=new if fused else None, launch=launch)
        outs.append([out, pages.k.float(), pages.v.float()])
    for x, y in zip(*outs, strict=True):
        assert torch.equal(x.nan_to_num(), y.nan_to_num())
