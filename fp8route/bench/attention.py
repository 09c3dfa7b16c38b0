"""The flat-batch paged attention (fp8route.kernels.paged_attention) against what the engine ran before
it, on Llama-3.1-8B's heads (32 query, 8 KV, head 128, bf16; blocks of 16), each checked against the
torch path first:

- decode: B rows at one context: RoPE + cache write + paged_attention's split-KV grid, against the
  decode kernel with the new token fused (fp8route.kernels.paged_decode) in each of its launches asked
  for, inside one CUDA graph over several layer pools (L2 holds none); TB/s of the KV read;
- prefill: one fresh chunk of T tokens from the cache, against SDPA over the chunk's own q/k/v as the
  engine runs fresh chunks where it measures faster (torch's pick, and cuDNN's with K/V expanded to
  every head), and FlashInfer's
  paged prefill over the same cache (FA2 and FA3 kernels, where it is installed); TFLOP/s of the causal
  products (4 * T^2 / 2 * H * D);
- mixed: 255 decode rows at 1024 and one fresh 2048 chunk, one call, against decode kernel + SDPA;
- sweep: the multi-query grid's tilings on fresh chunks of 2048 and 8192 tokens.
"""

from __future__ import annotations

import functools
import importlib.util
import statistics
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fp8route.engine.flashinfer_attention import page_layout
from fp8route.errors import Fp8InputError
from fp8route.kernels import paged_attention as pa
from fp8route.kernels import paged_decode as pd
from fp8route.kernels.fused import rope_into_cache
from fp8route.tuning.timing import time_graph

H, HKV, D, PAGE = 32, 8, 128, 16
BF16 = torch.bfloat16
DECODE_CASES = ((1, 1024), (1, 8192), (64, 1024), (256, 1024), (64, 4096))
PREFILL_TOKENS = (512, 2048, 4096, 8192)


def parse_launches(text: str) -> list[pa.Launch]:
    """'BLOCK_MxTILExWARPSxSTAGES,...' as the multi-query grid's tilings."""
    launches = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        parts = item.split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise Fp8InputError(f"--launches: {item!r} is not BLOCK_MxTILExWARPSxSTAGES, e.g. 128x64x8x2")
        launches.append(pa.Launch(*(int(p) for p in parts)))
    if not launches:
        raise Fp8InputError("--launches: give at least one tiling, e.g. 128x64x8x2")
    return launches


def _median_us(fn: Callable[[], object]) -> float:
    import triton

    return triton.testing.do_bench(fn, return_mode="median") * 1e3


def _pools(rows: int, reach: int, layers: int, dtype: torch.dtype) -> list[pa.PagedKV]:
    per_row = -(-reach // PAGE)
    tables = (1 + torch.arange(rows * per_row, dtype=torch.int32, device="cuda")).view(rows, per_row)
    shape = (1 + rows * per_row, PAGE, HKV, D)
    scale = 0.05 if dtype == torch.float8_e4m3fn else 1.0

    def pool() -> pa.PagedKV:
        k, v = (torch.randn(shape, device="cuda").to(dtype) for _ in range(2))
        return pa.PagedKV(k, v, tables, scale, scale)

    return [pool() for _ in range(layers)]


def _sequences(queries: list[int], lengths: list[int], singles: int) -> pa.Sequences:
    cu = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return pa.Sequences(cu, torch.tensor(lengths, dtype=torch.int32, device="cuda"),
                        torch.arange(len(lengths), device="cuda"), singles)  # fmt: skip


def _check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    if not err < 2e-2:
        raise AssertionError(f"{what}: relative error {err:.2e} against the torch path")


def _own_kv(cache: pa.PagedKV, row: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's first `tokens` keys and values as SDPA takes them: [1, HKV, T, D]."""
    k, v = (x[cache.tables[row].long()].flatten(0, 1)[:tokens].transpose(0, 1)[None] for x in (cache.k, cache.v))
    return k, v


def decode(
    batch: int, ctx: int, layers: int, cache_dtype: torch.dtype, launches: Sequence[pd.Launch | None] = (None,)
) -> tuple[float, list[float], float]:
    """(paged_attention µs, decode kernel µs in each launch (None: its default), KV TB/s of
    paged_attention) for `batch` rows at `ctx`."""
    caches = _pools(batch, ctx, layers, cache_dtype)
    q = torch.randn(batch, H, D, device="cuda", dtype=BF16)
    k_new, v_new = (torch.randn(batch, 1, HKV, D, device="cuda", dtype=BF16) for _ in range(2))
    cos, sin = torch.ones(batch, 1, D, device="cuda"), torch.zeros(batch, 1, D, device="cuda")
    seqs = _sequences([1] * batch, [ctx] * batch, batch)
    rows, lengths = seqs.rows, seqs.lengths.long()
    slots = caches[0].tables[rows, (ctx - 1) // PAGE].long() * PAGE + (ctx - 1) % PAGE
    _check(pa.paged_attention(q, caches[0], seqs), pa.paged_attention_reference(q, caches[0], seqs), "decode")

    def ours(c: pa.PagedKV) -> None:
        k_flat, v_flat = (x.view(-1, HKV, D) for x in (c.k, c.v))
        scales = None if c.k_scale == 1.0 else (c.k_scale, c.v_scale)
        rope_into_cache(k_new, v_new, cos, sin, k_flat, v_flat, slots, scales)
        pa.paged_attention(q, c, seqs)

    def before(c: pa.PagedKV, launch: pd.Launch | None) -> None:
        pages = pd.Pages(c.k, c.v, c.tables, rows, c.k_scale, c.v_scale)
        token = pd.NewToken(k_new[:, 0], v_new[:, 0], cos[:, 0], sin[:, 0])
        pd.decode_attention(q, pages, lengths, new=token, launch=launch)

    new = statistics.median(time_graph([functools.partial(ours, c) for c in caches], repeats=20))
    old = [
        statistics.median(time_graph([functools.partial(before, c, launch) for c in caches], repeats=20))
        for launch in launches
    ]
    kv_bytes = 2 * batch * ctx * HKV * D * cache_dtype.itemsize
    return new, old, kv_bytes / (new * 1e-6) / 1e12


class PrefillTimes(NamedTuple):
    """One fresh chunk's attention in µs: paged_attention, SDPA (torch's pick), cuDNN's SDPA, and
    FlashInfer's paged prefill with its FA2 and FA3 kernels (None where one cannot run here)."""

    paged: float
    sdpa: float
    cudnn: float | None
    fa2: float | None
    fa3: float | None

    def tflops(self, tokens: int, us: float) -> float:
        return 2 * tokens * tokens * H * D / (us * 1e-6) / 1e12


def prefill(tokens: int) -> PrefillTimes:
    """Each arm on one fresh chunk of `tokens`, checked against SDPA first."""
    q, cache, seqs = _chunk(tokens, 0, BF16)
    k, v = _own_kv(cache, 0, tokens)
    q4 = q.transpose(0, 1)[None]
    sdpa = F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=True)
    expected = sdpa[0].transpose(0, 1)
    _check(pa.paged_attention(q, cache, seqs), expected, "prefill")
    others: dict[str, Callable[[], Callable[[], torch.Tensor] | None]] = {
        "cuDNN": functools.partial(_cudnn_prefill, q4, k, v),
        **{f"FlashInfer {b}": functools.partial(_flashinfer_prefill, q, cache, tokens, b) for b in ("fa2", "fa3")},
    }
    calls = [_checked_arm(name, make, expected, tokens) for name, make in others.items()]
    return PrefillTimes(
        _median_us(lambda: pa.paged_attention(q, cache, seqs)),
        _median_us(lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=True)),
        *(None if call is None else _median_us(call) for call in calls),
    )


def _checked_arm(
    name: str, make: Callable[[], Callable[[], torch.Tensor] | None], expected: torch.Tensor, tokens: int
) -> Callable[[], torch.Tensor] | None:
    """An arm's call once it gave the expected output; None where it is absent or cannot run here (a
    line says why: an arm that fails is a row's gap, not the end of the run)."""
    try:
        call = make()
        if call is not None:
            _check(call(), expected, f"prefill {name}")
        return call
    except Exception as exc:  # noqa: BLE001
        print(f"{name} at {tokens} tokens: {type(exc).__name__}: {str(exc)[:200]}")
        return None


def _cudnn_prefill(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], torch.Tensor]:
    """cuDNN's SDPA by name, K/V expanded to every query head (it takes no GQA); [T, H, D] out."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k_all, v_all = (x.repeat_interleave(H // HKV, dim=1) for x in (k, v))

    def call() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q4, k_all, v_all, is_causal=True)[0].transpose(0, 1)

    return call


def _flashinfer_prefill(
    q: torch.Tensor, cache: pa.PagedKV, tokens: int, backend: str
) -> Callable[[], torch.Tensor] | None:
    """FlashInfer's paged prefill of one fresh chunk over row 0's blocks (what attention="flashinfer"
    runs), planned once; None without FlashInfer. [T, H, D] out."""
    if importlib.util.find_spec("flashinfer") is None:
        return None
    import flashinfer

    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
    indptr, indices, last = page_layout([cache.tables[0].tolist()], [tokens], PAGE)
    wrapper.plan(
        torch.tensor([0, tokens], dtype=torch.int32), indptr, indices, last,
        H, HKV, D, PAGE, causal=True, q_data_type=BF16, kv_data_type=BF16,
    )  # fmt: skip
    return lambda: wrapper.run(q, (cache.k, cache.v))


def mixed(decodes: int = 255, ctx: int = 1024, chunk: int = 2048) -> tuple[float, float]:
    """(one paged_attention call, decode kernel + SDPA) for decode rows and one fresh chunk in one step."""
    (cache,) = _pools(decodes + 1, max(ctx, chunk), 1, BF16)
    q = torch.randn(decodes + chunk, H, D, device="cuda", dtype=BF16)
    seqs = _sequences([1] * decodes + [chunk], [ctx] * decodes + [chunk], decodes)
    _check(pa.paged_attention(q, cache, seqs), pa.paged_attention_reference(q, cache, seqs), "mixed")
    pages = pd.Pages(cache.k, cache.v, cache.tables, seqs.rows[:decodes])
    lengths = seqs.lengths[:decodes].long()
    k, v = _own_kv(cache, decodes, chunk)
    q4 = q[decodes:].transpose(0, 1)[None]

    def before() -> None:
        pd.decode_attention(q[:decodes], pages, lengths)
        F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=True)

    return _median_us(lambda: pa.paged_attention(q, cache, seqs)), _median_us(before)


# --sweep's chunks: (new tokens, positions before them, cache dtype).
SWEEP_CHUNKS = ((2048, 0, BF16), (8192, 0, BF16), (2048, 6144, BF16), (2048, 6144, torch.float8_e4m3fn))


def _chunk(tokens: int, before: int, cache_dtype: torch.dtype) -> tuple[torch.Tensor, pa.PagedKV, pa.Sequences]:
    """One chunk of `tokens` new tokens after `before` cached ones, all in one row's blocks."""
    (cache,) = _pools(1, before + tokens, 1, cache_dtype)
    q = torch.randn(tokens, H, D, device="cuda", dtype=BF16)
    return q, cache, _sequences([tokens], [before + tokens], 0)


def sweep(launches: list[pa.Launch]) -> list[str]:
    """Markdown rows: each tiling on fresh chunks of 2048 and 8192 tokens and on 2048 continuing 6144 cached,
    bf16 and fp8 caches (one that fails is a row). TFLOP/s counts the causal products each query sees."""
    lines = ["| launch | T | cached | cache | us | TFLOP/s |", "|---|---|---|---|---|---|"]
    for tokens, before, cache_dtype in SWEEP_CHUNKS:
        q, cache, seqs = _chunk(tokens, before, cache_dtype)
        ref = pa.paged_attention_reference(q, cache, seqs)
        flops = 4 * tokens * (before + (tokens + 1) / 2) * H * D
        where = f"{tokens} | {before} | {'fp8' if cache_dtype == torch.float8_e4m3fn else 'bf16'}"
        for launch in launches:

            def call(launch: pa.Launch = launch, q: torch.Tensor = q, cache: pa.PagedKV = cache,
                     seqs: pa.Sequences = seqs) -> torch.Tensor:  # fmt: skip
                return pa.paged_attention(q, cache, seqs, launch=launch)

            try:
                _check(call(), ref, str(launch))
                us = _median_us(call)
            except Exception as exc:  # noqa: BLE001 (a tiling that does not compile is a row, not the end)
                lines.append(f"| {tuple(launch)} | {where} | {type(exc).__name__}: {str(exc)[:60]} | |")
                continue
            lines.append(f"| {tuple(launch)} | {where} | {us:.0f} | {flops / us / 1e6:.0f} |")
    return lines
