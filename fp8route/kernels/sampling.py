"""The sampler's CUDA kernels: the processed logits (penalties, maxima), top-k candidates, the top_p
cut, the seeded draws and logprob statistics, with no sort of the vocabulary.

A step that samples 150 rows of Llama-3's 128256 logits with torch ops spends milliseconds in full-
vocabulary sorts, int64 hash tensors and the penalty gathers' temporaries: longer than the decode
forward's own share. Here:
- process: the logits as float32 with vLLM's repetition / frequency / presence penalties from the
  per-row counts, and each row's maximum, in one pass.
- apply_bitmask_: a grammar's token bitmask (xgrammar's) as -inf logits, in place.
- top_candidates: each row's k largest logits and their ids, as int64 keys (the value's bits, then
  the id) that are all distinct: the k-th largest chunk maximum bounds the k-th key from below, so
  exactly k chunks hold keys at or above it; those k chunks' top keys (Triton's bitonic topk over 512
  logits each), then torch's topk over those few. Compiled per size class of k (size_class), not per
  k, so that the engine's warm-up can compile every class a step may meet.
- nucleus_floor: each row's top_p cut as a logit threshold, searched 8-fold narrower a round over 9
  rounds (FlashInfer's sampling kernels search a pivot alike), each round a launch of a program per
  8192 logits of every row.
- draw: the exponential race as a Gumbel-max, argmax over the kept tokens of
  (x - max) / T - log(-log U), U from a hash of (seed, step) and the token id: a row's token depends
  on its own seed and step only, whatever shares its batch. draw_top_k: a top_k row's k-th, top_p
  cut and draw over its candidates, in one program.
- logprob_stats: each row's log-sum-exp and the rank of a token in one pass (a program per slice of
  a row, then a small one a row).

fp8route.engine.sampler holds the same operations in torch (the CPU path and these kernels' oracle).
"""

from __future__ import annotations

import torch

from fp8route.kernels.launcher import DirectLauncher, int_key
from fp8route.kernels.triton_support import TRITON_IMPORT_ERROR, tl, triton

# splitmix64's multipliers (seed, step, finalizer) and murmur3's 32-bit ones (token id, finalizer).
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
ID_MUL, FMIX1, FMIX2 = 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35
_CHUNK = 2048  # the logits one program reads
MAX_CANDIDATES = 2048  # the most top_candidates finds
_TOP_CHUNK = 512  # the logits of a top_candidates chunk (fewer for a k past vocab / 512)
_GROUP = 4  # the chunks one top_candidates program takes: a program per chunk spends its time starting
_NO_KEY = -(2**63)  # below every key top_candidates makes
_SLICE = 8192  # a row's logits one search program reads
_STATS_SLICE = 16384  # a row's logits one logprob_stats program reads
_PIVOTS = 8  # a round narrows the search 8-fold: 9 rounds reach 2**-27 of its window
_ROUNDS = 9
# The search starts this many temperatures below the row's top: a token lower has e**-40 of its mass.
_WINDOW = 40.0


def available(x: torch.Tensor) -> bool:
    """Whether the sampler takes the kernels for x: a CUDA tensor, with Triton (tests also call the
    kernels on CPU tensors under Triton's interpreter)."""
    if TRITON_IMPORT_ERROR is not None or torch.compiler.is_compiling():
        return False
    return x.is_cuda


def process(
    logits: torch.Tensor, out: torch.Tensor, table: torch.Tensor, counts: torch.Tensor | None,
    seen: torch.Tensor | None, factors: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """out (float32 [R, V]) = logits [R, V] (out itself allowed) penalized: row i by table row table[i]'s
    counts (int32) and seen (bool) [rows, V], with factors [3, R] = (repetition, frequency, presence),
    a row of neutral factors (1, 0, 0) untouched; None: no penalties. -> each row's maximum, [R]."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, _CHUNK)
    maxima = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    if rows:
        if counts is not None and seen is not None and factors is not None:
            tables, penalized = (counts, seen, factors), True
        else:
            tables, penalized = (out, out, out), False  # unread
        args = (logits, out, table, *tables, maxima, logits.stride(0), out.stride(0), tables[0].stride(0), vocab,
                rows, chunks)  # fmt: skip
        key = (logits.dtype, int_key(logits.stride(0), out.stride(0), tables[0].stride(0), chunks), vocab)
        _PROCESS((rows, chunks), key, args, {"CHUNK": _CHUNK, "PENALIZE": penalized, "num_warps": 4})
    return maxima.amax(dim=-1)


def apply_bitmask_(x: torch.Tensor, where: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place on float32 x [R, V]: -inf in row where[i] wherever bitmask[i] (int32 [n, ceil(V / 32)],
    bit b of word w for token 32 w + b: xgrammar's layout) has a 0 bit."""
    n, vocab = where.numel(), x.shape[1]
    if n:
        args = (x, where, bitmask, x.stride(0), bitmask.stride(0), vocab)
        key = (int_key(x.stride(0), bitmask.stride(0)), vocab)
        _MASK((n, triton.cdiv(vocab, _CHUNK)), key, args, {"CHUNK": _CHUNK, "num_warps": 4})


def size_class(k: int) -> int:
    """k rounded up to a power of two, 16 at least. top_candidates' and draw_top_k's kernels are
    compiled per class (k itself is not specialized on), so that a step compiles none for a k whose
    class another k met before."""
    return max(16, 1 << (k - 1).bit_length())


def top_candidates(x: torch.Tensor, where: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row where[i] of x [R, V]'s k largest values (float32, highest first) and their ids (int64),
    each [n, k]; the lower id first among equal values. k at most MAX_CANDIDATES."""
    n, vocab = where.numel(), x.shape[1]
    size = size_class(k)
    chunk = _chunk_for(vocab, size)  # by the class: any k of it finds its k chunks among as many
    if chunk == 0:  # too few chunks to bound the k-th: a stable sort of the rows (the keys' order)
        rows = x.index_select(0, where).float().sort(dim=-1, descending=True, stable=True)
        return rows.values[:, :k], rows.indices[:, :k]
    chunks, width = triton.cdiv(vocab, chunk), min(size, chunk)
    maxima = torch.empty((n, chunks), dtype=torch.int64, device=x.device)
    keys = torch.full((n, k, width), _NO_KEY, dtype=torch.int64, device=x.device)
    if n:
        key = (x.dtype, int_key(x.stride(0), chunks), vocab)
        grid = (n, triton.cdiv(chunks, _GROUP))
        meta = {"CHUNK": chunk, "GROUP": _GROUP, "num_warps": 4}
        _MAX_KEY(grid, key, (x, where, maxima, x.stride(0), vocab, chunks), meta)
        bound = _kth(maxima, k)
        slots = torch.zeros(n, dtype=torch.int32, device=x.device)
        args = (x, where, maxima, bound, slots, keys, x.stride(0), vocab, chunks, k)
        _GATHER(grid, key, args, {**meta, "WIDTH": width})
    top = keys.view(n, k * width).topk(k, dim=-1).values
    ordered = (top >> 32).to(torch.int32)
    values = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).view(torch.float32)
    return values, 0xFFFFFFFF - (top & 0xFFFFFFFF)


def _kth(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest of each row of keys [n, m] (int64), [n]: one program a row while a row fits one."""
    n, m = keys.shape
    if m > _TOP_CHUNK:
        return keys.topk(k, dim=-1, sorted=False).values.amin(dim=-1)
    kth = torch.empty(n, dtype=torch.int64, device=keys.device)
    meta = {"BLOCK": max(16, triton.next_power_of_2(m)), "K": size_class(k), "num_warps": 4}
    _KTH((n,), (int_key(keys.stride(0), m),), (keys, kth, keys.stride(0), m, k), meta)
    return kth


def _chunk_for(vocab: int, k: int) -> int:
    """The largest power-of-two chunk, _TOP_CHUNK at most and 16 at least, that splits a row of vocab
    into k chunks or more (0: none does): the k-th largest chunk maximum bounds the row's k-th value."""
    chunk = _TOP_CHUNK
    while chunk >= 16 and triton.cdiv(vocab, chunk) < k:
        chunk //= 2
    return chunk if chunk >= 16 else 0


def nucleus_floor(
    x: torch.Tensor, where: torch.Tensor, top: torch.Tensor, floor: torch.Tensor, temperature: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The lowest logit row where[i] of x keeps under top_p[i], float32 [n]: the tokens at or above
    floor[i] (min_p, top_k), at temperature[i], whose probability mass ahead of them is at most
    top_p[i] (top: each row's maximum)."""
    n, vocab = where.numel(), x.shape[1]
    slices = triton.cdiv(vocab, _SLICE)
    sums = torch.empty((_ROUNDS, n, slices, _PIVOTS), dtype=torch.float32, device=x.device)
    bounds = torch.empty((_ROUNDS + 1, n, 2), dtype=torch.float32, device=x.device)
    lows = torch.empty((n, slices), dtype=torch.float32, device=x.device)
    if n == 0:
        return lows[:, 0]
    meta = {"SLICE": _SLICE, "BLOCK": 512, "PIVOTS": _PIVOTS, "SLICES": triton.next_power_of_2(slices),
            "WINDOW": _WINDOW, "num_warps": 4}  # fmt: skip
    for round_ in range(_ROUNDS + 1):
        args = (x, where, top, floor, temperature, top_p, bounds, sums, lows, x.stride(0), vocab, n, round_)
        final = round_ == _ROUNDS
        _SEARCH((n, slices), (int_key(x.stride(0)), vocab, final), args, {**meta, "FINAL": final})
    return lows.amin(dim=-1)


def draw(
    x: torch.Tensor, where: torch.Tensor, top: torch.Tensor, floor: torch.Tensor, temperature: torch.Tensor,
    seeds: torch.Tensor, steps: torch.Tensor, skip: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Row where[i] of x's token, int64 [n]: argmax over x >= floor[i] of
    (x - top[i]) / temperature[i] - log(-log U(seeds[i], steps[i], token)); 0 where skip[i] (int64) is
    not 0 (a row drawn elsewhere)."""
    n, vocab = where.numel(), x.shape[1]
    chunks = triton.cdiv(vocab, _CHUNK)
    keys = torch.empty((n, chunks), dtype=torch.float32, device=x.device)
    ids = torch.empty((n, chunks), dtype=torch.int64, device=x.device)
    if n:
        args = (x, where, top, floor, temperature, seeds, steps, skip, keys, ids, x.stride(0), vocab, chunks)
        _DRAW((n, chunks), (int_key(x.stride(0), chunks), vocab), args, {"CHUNK": _CHUNK, "num_warps": 4})
    return ids.gather(1, keys.argmax(-1, keepdim=True))[:, 0]


def draw_top_k(
    values: torch.Tensor, ids: torch.Tensor, k: torch.Tensor, top: torch.Tensor, floor: torch.Tensor,
    temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The token of a top_k row, int64 [n]: row i's candidates are values[i] (float32, highest first,
    each row's m contiguous) with token ids ids[i] (int64), and its controls those of row k[i] of
    top, floor, temperature, top_p, top_k (int64) and seeds and steps. It keeps its first top_k
    candidates, raises floor to the k-th and to its top_p cut of their mass, and draws as draw does."""
    n, m = values.shape
    tokens = torch.empty(n, dtype=torch.int64, device=values.device)
    if n:
        args = (values, ids, k, top, floor, temperature, top_p, top_k, seeds, steps, tokens, values.stride(0),
                ids.stride(0), m)  # fmt: skip
        _DRAW_TOP_K((n,), (), args, {"BLOCK": size_class(m), "num_warps": 4})
    return tokens


def logprob_stats(logits: torch.Tensor, where: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """For row where[i] of logits [R, V] and its token tokens[i]: (log-sum-exp, the token's logit,
    its rank: 1 + the tokens with a larger logit), each [n]: each slice of a row in a program of its
    own, then one program a row sums them."""
    n, vocab = where.numel(), logits.shape[1]
    slices = triton.cdiv(vocab, _STATS_SLICE)
    parts = torch.empty((3, n, slices), dtype=torch.float32, device=logits.device)  # maxima, sums, larger
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    own = torch.empty(n, dtype=torch.float32, device=logits.device)
    rank = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        args = (logits, where, tokens, parts, own, logits.stride(0), vocab, n * slices)
        key = (logits.dtype, int_key(logits.stride(0)), vocab)  # n * slices is not specialized on
        _STATS((n, slices), key, args, {"SLICE": _STATS_SLICE, "BLOCK": _CHUNK, "num_warps": 8})
        meta = {"SLICES": triton.next_power_of_2(slices), "num_warps": 1}
        _STATS_SUM((n,), (int_key(slices),), (parts, lse, rank, n * slices, slices), meta)
    return lse, own, rank


if TRITON_IMPORT_ERROR is None:

    @triton.jit
    def _fmix32(h):
        h ^= h >> 16
        h *= 0x85EBCA6B
        h ^= h >> 13
        h *= 0xC2B2AE35
        return h ^ (h >> 16)

    @triton.jit
    def uniform(seed, step, ids):
        """U(0, 1) float32 for token ids: splitmix64 of seed * GOLDEN + step * MIX2 gives the row's 64
        bits, murmur3's finalizer mixes them with id * ID_MUL (32-bit ops: the per-token part is cheap);
        its top 24 bits."""
        z = (
            seed.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15
            + step.to(tl.uint64, bitcast=True) * 0x94D049BB133111EB
        )
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        h = _fmix32((ids.to(tl.uint32) * 0x9E3779B1) ^ z.to(tl.uint32))
        h = _fmix32(h ^ (z >> 32).to(tl.uint32))
        return ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)

    @triton.jit(do_not_specialize=["rows"])
    def _process_kernel(
        src_ptr, out_ptr, table_ptr, counts_ptr, seen_ptr, factors_ptr, maxima_ptr, src_stride, out_stride,
        table_stride, vocab, rows, chunks, CHUNK: tl.constexpr, PENALIZE: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0)
        chunk = tl.program_id(1)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        inside = offs < vocab
        x = tl.load(src_ptr + i * src_stride + offs, mask=inside, other=float("-inf")).to(tl.float32)
        if PENALIZE:
            rep = tl.load(factors_ptr + i)
            freq = tl.load(factors_ptr + rows + i)
            pres = tl.load(factors_ptr + 2 * rows + i)
            if (rep != 1.0) | (freq != 0.0) | (pres != 0.0):
                t = tl.load(table_ptr + i) * table_stride
                count = tl.load(counts_ptr + t + offs, mask=inside, other=0)
                seen = tl.load(seen_ptr + t + offs, mask=inside, other=0) != 0
                appeared = count > 0
                x = tl.where(seen | appeared, tl.where(x > 0, x / rep, x * rep), x)
                x = x - freq * count.to(tl.float32) - pres * appeared.to(tl.float32)
        tl.store(out_ptr + i * out_stride + offs, x, mask=inside)
        tl.store(maxima_ptr + i * chunks + chunk, tl.max(x, axis=0))

    @triton.jit
    def _mask_kernel(x_ptr, where_ptr, bits_ptr, x_stride, bits_stride, vocab, CHUNK: tl.constexpr):
        i = tl.program_id(0)
        offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        inside = offs < vocab
        words = tl.load(bits_ptr + i * bits_stride + offs // 32, mask=inside, other=-1)
        allowed = ((words >> (offs % 32)) & 1) != 0
        x_row = x_ptr + tl.load(where_ptr + i) * x_stride
        tl.store(x_row + offs, float("-inf"), mask=inside & ~allowed)

    @triton.jit
    def _keys(x_row, offs, vocab):
        """int64 keys ordered as the logits at offs, the lower id first among equal ones; padding lowest."""
        inside = offs < vocab
        x = tl.load(x_row + offs, mask=inside, other=0.0).to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # ordered as the floats, as int32
        key = (ordered.to(tl.int64) << 32) + (0xFFFFFFFF - offs.to(tl.int64))
        return tl.where(inside, key, -0x7FFFFFFFFFFFFFFF - 1)

    @triton.jit
    def _max_key_kernel(
        x_ptr, where_ptr, maxima_ptr, x_stride, vocab, chunks, CHUNK: tl.constexpr, GROUP: tl.constexpr
    ):
        i = tl.program_id(0)
        chunk = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
        offs = chunk[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        key = _keys(x_ptr + tl.load(where_ptr + i) * x_stride, offs, vocab)
        tl.store(maxima_ptr + i * chunks + chunk, tl.max(key, axis=1), mask=chunk < chunks)

    @triton.jit(do_not_specialize=["k"])
    def _kth_kernel(keys_ptr, kth_ptr, stride, m, k, BLOCK: tl.constexpr, K: tl.constexpr):
        i = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        key = tl.load(keys_ptr + i * stride + offs, mask=offs < m, other=-0x7FFFFFFFFFFFFFFF - 1)
        top = tl.topk(key, K)
        tl.store(kth_ptr + i, tl.sum(tl.where(tl.arange(0, K) == k - 1, top, 0), axis=0))

    @triton.jit(do_not_specialize=["k"])
    def _gather_kernel(
        x_ptr, where_ptr, maxima_ptr, bound_ptr, slots_ptr, keys_ptr, x_stride, vocab, chunks, k,
        CHUNK: tl.constexpr, WIDTH: tl.constexpr, GROUP: tl.constexpr,
    ):  # fmt: skip
        """Each of the program's chunks whose maximum key is at or above the row's bound (k chunks a
        row are) writes its top WIDTH keys, those below the bound as the lowest key, into the row's
        next slot."""
        i = tl.program_id(0)
        bound = tl.load(bound_ptr + i)
        x_row = x_ptr + tl.load(where_ptr + i) * x_stride
        for j in range(GROUP):
            chunk = tl.program_id(1) * GROUP + j
            most = tl.load(maxima_ptr + i * chunks + chunk, mask=chunk < chunks, other=-0x7FFFFFFFFFFFFFFF - 1)
            if most >= bound:  # a real key always is above the lowest
                slot = tl.atomic_add(slots_ptr + i, 1)
                key = _keys(x_row, chunk * CHUNK + tl.arange(0, CHUNK), vocab)
                key = tl.where(key >= bound, key, -0x7FFFFFFFFFFFFFFF - 1)
                if WIDTH < CHUNK:
                    key = tl.topk(key, WIDTH)
                tl.store(keys_ptr + ((i * k + slot) * WIDTH).to(tl.int64) + tl.arange(0, WIDTH), key)

    @triton.jit(do_not_specialize=["n", "round_"])
    def _search_kernel(
        x_ptr, where_ptr, top_ptr, floor_ptr, temp_ptr, top_p_ptr, bounds_ptr, sums_ptr, lows_ptr, x_stride,
        vocab, n, round_, SLICE: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr, SLICES: tl.constexpr,
        WINDOW: tl.constexpr, FINAL: tl.constexpr,
    ):  # fmt: skip
        """One round of the top_p search for row i's slice s. Invariant: the mass above logit hi is at
        most the target, the mass above lo is more. A round's pivots split [lo, hi) in PIVOTS; the first
        is lo, whose mass in round 0 is the row's (the target's base)."""
        i = tl.program_id(0)
        s = tl.program_id(1)
        slices = tl.num_programs(1)
        x_row = x_ptr + tl.load(where_ptr + i) * x_stride
        top = tl.load(top_ptr + i)
        floor = tl.load(floor_ptr + i)
        temp = tl.load(temp_ptr + i)
        steps = tl.arange(0, PIVOTS)
        if round_ == 0:
            lo = tl.maximum(floor, top - WINDOW * temp)
            lo = lo - (tl.abs(lo) + 1.0) * 1e-6  # tokens at the window's edge (or at floor) lie above it
            hi = top
        else:
            before = bounds_ptr + ((round_ - 1) * n + i) * 2
            lo = tl.load(before)
            hi = tl.load(before + 1)
            pivots = lo + (hi - lo) * (steps.to(tl.float32) / PIVOTS)
            parts = tl.arange(0, SLICES)[:, None] * PIVOTS + steps[None, :]
            inside = tl.arange(0, SLICES)[:, None] < slices
            above = tl.sum(
                tl.load(sums_ptr + ((round_ - 1) * n + i) * slices * PIVOTS + parts, mask=inside, other=0.0), 0
            )
            whole = tl.sum(tl.load(sums_ptr + i * slices * PIVOTS + tl.arange(0, SLICES) * PIVOTS,
                                   mask=tl.arange(0, SLICES) < slices, other=0.0), 0)  # fmt: skip
            target = tl.load(top_p_ptr + i) * whole
            first = tl.min(tl.where((above <= target) & (steps > 0), steps, PIVOTS), axis=0)
            new_lo = tl.sum(tl.where(steps == first - 1, pivots, 0.0), axis=0)
            hi = tl.where(first < PIVOTS, tl.sum(tl.where(steps == first, pivots, 0.0), axis=0), hi)
            lo = new_lo
        if s == 0:
            tl.store(bounds_ptr + (round_ * n + i) * 2, lo)
            tl.store(bounds_ptr + (round_ * n + i) * 2 + 1, hi)
        start = s * SLICE
        if FINAL:  # the lowest kept logit: the lowest above lo
            low = tl.full([BLOCK], float("inf"), dtype=tl.float32)
            for offset in range(0, SLICE, BLOCK):
                offs = start + offset + tl.arange(0, BLOCK)
                x = tl.load(x_row + offs, mask=offs < vocab, other=float("-inf"))
                low = tl.minimum(low, tl.where((x > lo) & (x >= floor), x, float("inf")))
            tl.store(lows_ptr + i * slices + s, tl.min(low, axis=0))
        else:
            pivots = lo + (hi - lo) * (steps.to(tl.float32) / PIVOTS)
            scale = 1.0 / temp
            acc = tl.zeros([PIVOTS, BLOCK], dtype=tl.float32)
            for offset in range(0, SLICE, BLOCK):
                offs = start + offset + tl.arange(0, BLOCK)
                x = tl.load(x_row + offs, mask=offs < vocab, other=float("-inf"))
                e = tl.where(x >= floor, tl.exp((x - top) * scale), 0.0)
                acc += tl.where(x[None, :] > pivots[:, None], e[None, :], 0.0)
            tl.store(sums_ptr + ((round_ * n + i) * slices + s) * PIVOTS + steps, tl.sum(acc, axis=1))

    @triton.jit
    def _draw_kernel(
        x_ptr, where_ptr, top_ptr, floor_ptr, temp_ptr, seed_ptr, step_ptr, skip_ptr, key_ptr, id_ptr, x_stride,
        vocab, chunks, CHUNK: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0)
        chunk = tl.program_id(1)
        if tl.load(skip_ptr + i) != 0:
            tl.store(key_ptr + i * chunks + chunk, float("-inf"))
            tl.store(id_ptr + i * chunks + chunk, 0)
        else:
            offs = chunk * CHUNK + tl.arange(0, CHUNK)
            x = tl.load(x_ptr + tl.load(where_ptr + i) * x_stride + offs, mask=offs < vocab, other=float("-inf"))
            u = uniform(tl.load(seed_ptr + i), tl.load(step_ptr + i), offs)
            key = (x - tl.load(top_ptr + i)) / tl.load(temp_ptr + i) - tl.log(-tl.log(u))
            key = tl.where((x >= tl.load(floor_ptr + i)) & (x > float("-inf")), key, float("-inf"))
            best, at = tl.max(key, axis=0, return_indices=True, return_indices_tie_break_left=True)
            tl.store(key_ptr + i * chunks + chunk, best)
            tl.store(id_ptr + i * chunks + chunk, (chunk * CHUNK + at).to(tl.int64))

    @triton.jit(do_not_specialize=["values_stride", "ids_stride", "m"])
    def _draw_top_k_kernel(
        values_ptr, ids_ptr, k_ptr, top_ptr, floor_ptr, temp_ptr, top_p_ptr, top_k_ptr, seed_ptr, step_ptr,
        token_ptr, values_stride, ids_stride, m, BLOCK: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0)
        j = tl.load(k_ptr + i)
        keep = tl.load(top_k_ptr + j)
        offs = tl.arange(0, BLOCK)
        inside = offs < tl.minimum(m, keep)  # its top_k, not the step's most
        v = tl.load(values_ptr + i * values_stride + offs, mask=inside, other=float("-inf"))
        ids = tl.load(ids_ptr + i * ids_stride + offs, mask=inside, other=0)
        top = tl.load(top_ptr + j)
        temp = tl.load(temp_ptr + j)
        kth = tl.sum(tl.where(offs == keep - 1, v, 0.0), axis=0)
        floor = tl.maximum(tl.load(floor_ptr + j), kth)
        kept = v >= floor
        e = tl.where(kept, tl.exp((v - top) / temp), 0.0)
        ahead = tl.cumsum(e, axis=0) - e
        nucleus = kept & (ahead <= tl.load(top_p_ptr + j) * tl.sum(e, axis=0))
        cut = tl.min(tl.where(nucleus, v, float("inf")), axis=0)
        u = uniform(tl.load(seed_ptr + j), tl.load(step_ptr + j), ids)
        key = (v - top) / temp - tl.log(-tl.log(u))
        key = tl.where((v >= cut) & (v > float("-inf")), key, float("-inf"))
        _, at = tl.max(key, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(token_ptr + i, tl.sum(tl.where(offs == at, ids, 0), axis=0))

    @triton.jit(do_not_specialize=["part_stride"])
    def _stats_kernel(
        x_ptr, where_ptr, token_ptr, parts_ptr, own_ptr, x_stride, vocab, part_stride, SLICE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Slice s of row i: its maximum, the sum of exp(x - that maximum), and the count of logits
        above the row's token's."""
        i = tl.program_id(0)
        s = tl.program_id(1)
        x_row = x_ptr + tl.load(where_ptr + i) * x_stride
        own = tl.load(x_row + tl.load(token_ptr + i)).to(tl.float32)
        if s == 0:
            tl.store(own_ptr + i, own)
        top = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        larger = tl.zeros([BLOCK], dtype=tl.int32)
        for offset in range(0, SLICE, BLOCK):
            offs = s * SLICE + offset + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
            new_top = tl.maximum(top, x)
            safe = tl.where(new_top > float("-inf"), new_top, 0.0)
            total = total * tl.exp(top - safe) + tl.exp(x - safe)
            top = new_top
            larger += (x > own).to(tl.int32)
        most = tl.max(top, axis=0)
        base = tl.where(most > float("-inf"), most, 0.0)
        part = parts_ptr + i * tl.num_programs(1) + s
        tl.store(part, most)
        tl.store(part + part_stride, tl.sum(total * tl.exp(tl.where(top > float("-inf"), top, base) - base), axis=0))
        tl.store(part + 2 * part_stride, tl.sum(larger, axis=0).to(tl.float32))  # exact below 2**24

    @triton.jit(do_not_specialize=["part_stride"])
    def _stats_sum_kernel(parts_ptr, lse_ptr, rank_ptr, part_stride, slices, SLICES: tl.constexpr):
        i = tl.program_id(0)
        offs = tl.arange(0, SLICES)
        inside = offs < slices
        part = parts_ptr + i * slices + offs
        most = tl.load(part, mask=inside, other=float("-inf"))
        sums = tl.load(part + part_stride, mask=inside, other=0.0)
        larger = tl.load(part + 2 * part_stride, mask=inside, other=0.0)
        top = tl.max(most, axis=0)
        base = tl.where(top > float("-inf"), top, 0.0)
        tl.store(lse_ptr + i, top + tl.log(tl.sum(sums * tl.exp(most - base), axis=0)))
        tl.store(rank_ptr + i, tl.sum(larger, axis=0).to(tl.int64) + 1)

    _PROCESS = DirectLauncher(_process_kernel, pointers=7)
    _MASK = DirectLauncher(_mask_kernel, pointers=3)
    _MAX_KEY = DirectLauncher(_max_key_kernel, pointers=3)
    _KTH = DirectLauncher(_kth_kernel, pointers=2)
    _GATHER = DirectLauncher(_gather_kernel, pointers=6)
    _SEARCH = DirectLauncher(_search_kernel, pointers=9)
    _DRAW = DirectLauncher(_draw_kernel, pointers=10)
    _DRAW_TOP_K = DirectLauncher(_draw_top_k_kernel, pointers=11)
    _STATS = DirectLauncher(_stats_kernel, pointers=5)
    _STATS_SUM = DirectLauncher(_stats_sum_kernel, pointers=3)
