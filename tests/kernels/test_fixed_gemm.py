"""The fixed-tile GEMM (fp8route.kernels.fixed_gemm): each scaling's product against its definition,
and the property it exists for: a row's output is the same bits whatever M is and however many
programs share its tile's chunks. On a CPU under Triton's interpreter (small tiles), on a GPU as is.

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_fixed_gemm.py
"""

from __future__ import annotations

import contextvars
from dataclasses import astuple, replace

import pytest
import torch
from helpers import GPU_OR_INTERPRETER

from fp8route.errors import Fp8InputError
from fp8route.kernels import fixed_gemm as fg
from fp8route.kernels import split_counters
from fp8route.schemes import quantize_activation, quantize_weight, scaled_matmul

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = GPU_OR_INTERPRETER
# The interpreter runs every program in Python: small tiles, K in several chunks. The block scheme's
# steps are its 128-wide groups.
SMALL = fg.FixedTiles(16, 32, 32, 2, 2, 4, 2) if not CUDA else fg.TILES
SMALL_BLOCK = fg.FixedTiles(16, 32, 128, 2, 2, 4, 2) if not CUDA else fg.TILES
SCHEMES = ["float", "tensor", "channel", "block"]
# The interpreter's tl.dot misreads bfloat16 operands (tests/kernels/test_paged_attention_interpreted.py):
# the 16-bit product is checked in float16 there.
HALF = torch.bfloat16 if CUDA else torch.float16


def operands(scheme: str, m: int, n: int, k: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """(x, weight, x_scale, weight_scale, bias, reference fp32 product, tiles) for one scheme."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m)[:, None]).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None]
    bias = (torch.randn(n, generator=g) * 0.5).to(torch.bfloat16)
    if scheme == "float":
        x, wb = x.to(HALF), w.to(HALF)
        return x, wb, None, None, bias, x.float() @ wb.float().t() + bias.float(), SMALL
    wq, ws = quantize_weight(w, scheme)
    if scheme == "tensor":
        xq, xs = quantize_activation(x, "tensor")
    else:
        xq, xs = quantize_activation(x, "channel" if scheme == "channel" else "block")
    ref = scaled_matmul(xq, xs, wq, ws, scheme) + bias.float()
    return xq, wq, xs, ws, bias, ref, SMALL_BLOCK if scheme == "block" else SMALL


def run(ops, rows=None, sms=None, monkeypatch=None, out_dtype=torch.bfloat16):  # type: ignore[no-untyped-def]
    x, w, xs, ws, bias, _, tiles = ops
    if rows is not None:
        x = x[rows]
        xs = xs[rows] if xs is not None and xs.numel() > 1 else xs
    if sms is not None:
        monkeypatch.setattr(fg, "launch_sms", lambda device: sms)
    dev = [t.to(DEVICE) if t is not None else None for t in (x, w, xs, ws, bias)]
    return fg.fixed_gemm(*dev, out_dtype, tiles).cpu()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("m,n,k", [(1, 96, 320), (37, 200, 400)], ids=str)
def test_each_scaling_gives_its_schemes_product(gpu_conversions, scheme, m, n, k):
    ops = operands(scheme, m, n, k, seed=m + n)
    out, ref = run(ops), ops[5]
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 4e-3, f"{scheme} M={m}: relative error {err:.2e} (bf16 output rounds to ~2e-3)"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_rows_bits_do_not_depend_on_m_or_on_the_split(gpu_conversions, monkeypatch, scheme):
    k = 3200 if CUDA else 1000 if scheme != "block" else 1100  # several chunks of the tiling run here, the last partial
    ops = operands(scheme, 70, 96, k, seed=3)
    x, w, tiles = ops[0], ops[1], ops[6]
    chunks = -(-x.shape[1] // (tiles.block_k * tiles.chunk_steps))
    assert chunks >= 3, "K must span several chunks for the split to mean anything"
    # fp32 out: a bf16 output would round most differences in the order of the sum away.
    alone_split = run(ops, slice(5, 6), 1000, monkeypatch, torch.float32)  # one tile: its chunks spread out
    assert fg.programs_per_tile(1, w.shape[0], x.shape[1], 1000, tiles) > 1
    together_whole = run(ops, None, 1, monkeypatch, torch.float32)  # every tile's chunks summed in one program
    assert fg.programs_per_tile(x.shape[0], w.shape[0], x.shape[1], 1, tiles) == 1
    few = run(ops, slice(3, 11), 4, monkeypatch, torch.float32)
    assert torch.equal(alone_split[0].view(torch.int32), together_whole[5].view(torch.int32))
    assert torch.equal(few[2].view(torch.int32), together_whole[5].view(torch.int32))
    assert not split_counters.left_set(torch.device(DEVICE)), "split-K counters left set"


def test_the_split_follows_the_tiles_and_never_exceeds_the_chunks():
    t = fg.TILES
    assert fg.programs_per_tile(8192, 4096, 4096, 132, t) == 1  # prefill: tiles fill the GPU
    k = 14336
    chunks = -(-k // (t.block_k * t.chunk_steps))
    tiles_at_m1 = 4096 // t.block_n
    assert fg.programs_per_tile(1, 4096, k, 132, t) == min(chunks, t.programs_per_sm * 132 // tiles_at_m1)
    assert fg.programs_per_tile(1, 128, k, 132, t) == chunks
    # Past a quarter of the weight's bytes in chunk sums, no split: at M=64 one tile row runs alone.
    assert fg.programs_per_tile(64, 128, k, 132, t) == 1
    assert fg.programs_per_tile(8, 128, k, 132, t, element_size=2) == chunks


def test_mismatched_operands_are_refused_with_the_reason():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    w = torch.zeros(64, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(Fp8InputError, match="must share a dtype"):
        fg.fixed_gemm(x, w, None, None, None, torch.bfloat16)
    xq = x.to(torch.float8_e4m3fn)
    with pytest.raises(Fp8InputError, match="need x_scale and weight_scale"):
        fg.fixed_gemm(xq, w, None, None, None, torch.bfloat16)
    with pytest.raises(Fp8InputError, match=r"x_scale must be \(2, 2\)"):
        fg.fixed_gemm(xq, w, torch.ones(2, 3), torch.ones(1, 2), None, torch.bfloat16)
    with pytest.raises(Fp8InputError, match=r"weight_scale must be a scalar or \[64\]"):
        fg.fixed_gemm(xq, w, torch.ones(2), torch.ones(3), None, torch.bfloat16)


INPUTS = [("tensor", True), ("tensor", False), ("channel", False), ("block", False)]
INSIDE = [("tensor", True), ("block", False)]  # what x quantized inside takes: a static scale or 1x128 groups


@pytest.mark.parametrize(
    "name,scheme,static",
    [
        (name, *inputs)
        for name in ("triton_fixed", "triton_fixed_wide", "triton_fixed_large", "triton_fixed_narrow")
        for inputs in INPUTS
    ]
    + [(name, *inputs) for name in ("triton_fixed_quantize", "triton_fixed_narrow_quantize") for inputs in INSIDE],
)
def test_the_backend_quantizes_each_row_alone_and_matches_the_reference(gpu_conversions, name, scheme, static):
    """Each tiling's backend as a layer runs it (on CPU tensors under the interpreter): the reference backend's
    numbers (a dynamic per-tensor scale taken per token, as each row alone would have it), and a row's
    bits the same alone and in a batch."""
    from fp8route.backends import BACKENDS, LinearOperands

    g = torch.Generator().manual_seed(11)
    x = (torch.randn(24, 256, generator=g) * torch.logspace(-1, 1, 24)[:, None]).to(torch.bfloat16).to(DEVICE)
    wq, ws = quantize_weight(torch.randn(64, 256, generator=g) * 0.1, scheme)
    input_scale = (x.float().abs().max() / 448).reshape(()) if static else None
    bias = (torch.randn(64, generator=g) * 0.1).to(torch.bfloat16).to(DEVICE)
    ops = LinearOperands.prepare(wq.to(DEVICE), ws.to(DEVICE), input_scale, bias, frozenset({"tensor"}), scheme)
    backend, reference = BACKENDS[name], BACKENDS["reference"]
    together = backend.run(x, ops).float()
    for row in (0, 9, 23):
        alone = backend.run(x[row : row + 1], ops).float()
        assert torch.equal(alone[0], together[row]), row
        ref = reference.run(x[row : row + 1], ops).float()
        assert ((alone - ref).norm() / ref.norm()).item() < 4e-3, row


# Tilings that differ in everything but their K chunking (block_k, chunk_steps): the tile's rows and
# columns, warps, stages and grouping. The interpreter's stand-ins keep that contrast at small sizes.
SAME_CHUNKING = (
    # (x quantized inside reads 16-bit x: test_x_quantized_inside_gives_the_bits_of_x_quantized_by_its_kernel)
    [
        *(t for t in fg.TILINGS.values() if not t.quantize_x),
        fg.FixedTiles(128, 256, 128, 8, 8, 8, 2, 1),
        fg.FixedTiles(256, 128, 128, 8, 8, 8, 3, 1, tma=True),
    ]
    if CUDA
    else [SMALL, fg.FixedTiles(32, 16, 32, 2, 1, 4, 1), fg.FixedTiles(16, 16, 32, 2, 4, 4, 3, 1)]
)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_tilings_that_share_the_k_chunking_give_a_row_the_same_bits(gpu_conversions, monkeypatch, scheme):
    """What lets the deterministic mode change the tiling with M: a row's sum is ordered by K alone."""
    k = 3200 if CUDA else 1100
    ops = operands(scheme, 300 if CUDA else 40, 520 if CUDA else 72, k, seed=5)
    first = None
    for tiles in SAME_CHUNKING:
        if scheme == "block":
            tiles = fg.FixedTiles(tiles.block_m, tiles.block_n, 128, *astuple(tiles)[3:])
        ops = (*ops[:6], tiles)
        whole = run(ops, out_dtype=torch.float32)
        alone = run(ops, slice(7, 8), out_dtype=torch.float32)
        if first is None:
            first = whole
        assert torch.equal(alone[0].view(torch.int32), whole[7].view(torch.int32)), f"{tiles}: M=1 vs M={len(whole)}"
        assert torch.equal(whole.view(torch.int32), first.view(torch.int32)), f"{tiles} vs {SAME_CHUNKING[0]}"


@pytest.mark.parametrize("scheme", ["tensor", "block"])
@pytest.mark.parametrize("m", [1, 37])
def test_x_quantized_inside_gives_the_bits_of_x_quantized_by_its_kernel(gpu_conversions, scheme, m):
    """Tiles with quantize_x read 16-bit x and quantize each tile with the quantizers' own device functions:
    the same e4m3 codes and scales as the quantizer's kernel, so the same bits after the GEMM."""
    from fp8route.kernels import quantize as triton_quantize

    g = torch.Generator().manual_seed(m)
    k = 3200 if CUDA else 1100 if scheme == "block" else 1000
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m)[:, None]).to(torch.bfloat16).to(DEVICE)
    wq, ws = (t.to(DEVICE) for t in quantize_weight(torch.randn(72, k, generator=g) * 0.1, scheme))
    tiles = SMALL_BLOCK if scheme == "block" else SMALL
    inside = replace(tiles, quantize_x=True)
    if scheme == "block":
        x_q, x_scale = triton_quantize.quantize_per_group(x)
        fused = fg.fixed_gemm(x, wq, None, ws, None, torch.float32, inside)
    else:
        x_scale = (x.float().abs().max() / 300).reshape(())  # some of x saturates at 448
        x_q = triton_quantize.quantize_fp8(x, x_scale)
        fused = fg.fixed_gemm(x, wq, x_scale, ws, None, torch.float32, inside)
    apart = fg.fixed_gemm(x_q, wq, x_scale, ws, None, torch.float32, tiles)
    assert torch.equal(fused.cpu().view(torch.int32), apart.cpu().view(torch.int32))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("k_pad", [16, 4], ids=["rows 16-byte aligned", "rows not aligned"])
def test_tma_loads_give_the_bits_of_pointer_loads(gpu_conversions, scheme, k_pad, monkeypatch, caplog):
    """Tiles loaded through TMA descriptors (zeros past M, N and K, as the masked loads: K ends inside a
    step) are the same operands, so the same bits; where a row is not 16-byte aligned the tiles load by
    pointers, and say so once."""
    monkeypatch.setattr(fg, "_pointer_loads_logged", set())
    k = (3200 if CUDA else 1088) + k_pad
    ops = operands(scheme, 300 if CUDA else 40, 520 if CUDA else 72, k, seed=9)
    plain = ops[6]
    got = {}
    for tma in (False, True):
        got[tma] = run((*ops[:6], replace(plain, tma=tma)), out_dtype=torch.float32)
    assert torch.equal(got[True].view(torch.int32), got[False].view(torch.int32))
    said = [r for r in caplog.records if "load by pointers" in r.getMessage() and r.levelname == "WARNING"]
    assert len(said) == (1 if k_pad % 16 else 0)
    if scheme in ("tensor", "block"):  # x quantized inside the tiles, read through its own descriptor
        x16 = ops[0].float() * (ops[2] if ops[2].dim() == 0 else 1.0)
        inside = [
            fg.fixed_gemm(x16.to(torch.bfloat16).to(DEVICE), ops[1].to(DEVICE), ops[2].to(DEVICE) if scheme == "tensor"
                          else None, ops[3].to(DEVICE), None, torch.float32, replace(plain, quantize_x=True, tma=tma))
            for tma in (False, True)
        ]  # fmt: skip
        assert torch.equal(inside[0].cpu().view(torch.int32), inside[1].cpu().view(torch.int32))


def test_tma_tiles_keep_a_triton_allocator_set_before_them():
    """The descriptors' scratch comes from Triton's allocator: ours where the context has none, a
    user's kept where one is set."""
    from triton.runtime._allocation import _allocator

    x, w = (
        torch.zeros(4, 64, dtype=torch.bfloat16, device=DEVICE),
        torch.zeros(32, 64, device=DEVICE).to(torch.float8_e4m3fn),
    )

    def users(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int8, device=DEVICE)

    def ready_after(allocator):  # type: ignore[no-untyped-def]
        if allocator is not None:
            fg.triton.set_allocator(allocator)
        assert fg._tma_ready(x, w)
        return _allocator.get()

    assert contextvars.Context().run(ready_after, None) is fg._scratch
    assert contextvars.Context().run(ready_after, users) is users


def test_tiles_that_quantize_inside_refuse_what_they_cannot_quantize():
    weight = torch.zeros(64, 256, dtype=torch.float8_e4m3fn)
    inside = fg.TILINGS["triton_fixed_quantize"]
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    with pytest.raises(Fp8InputError, match="static scale"):  # per token: the row's amax first
        fg.fixed_gemm(x, weight, torch.ones(2), torch.ones(()), None, torch.bfloat16, inside)
    with pytest.raises(Fp8InputError, match="16-bit x"):
        fg.fixed_gemm(x.to(torch.float8_e4m3fn), weight, torch.ones(()), torch.ones(()), None, torch.bfloat16, inside)
    with pytest.raises(Fp8InputError, match="computed inside"):
        fg.fixed_gemm(x, weight, torch.ones(2, 2), torch.ones(1, 2), None, torch.bfloat16, inside)


def test_the_stages_shrink_to_what_fits_shared_memory_and_never_below_one():
    wide = fg.TILINGS["triton_fixed_wide"]
    assert fg.stages_that_fit(wide, 1, split=True) == wide.num_stages == 4  # e4m3: 32 KiB a stage
    assert fg.stages_that_fit(wide, 2, split=False) == 3  # bf16: 64 KiB a stage
    assert fg.stages_that_fit(wide, 2, split=True) == 2  # and a 64 KiB fp32 tile for the chunk sums
    assert fg.stages_that_fit(fg.FixedTiles(256, 256, 256, 8, 8, 8, 4), 2, split=True) == 1
