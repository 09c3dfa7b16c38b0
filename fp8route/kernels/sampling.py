"""The sampler's CUDA kernels: penalties, the top_p cut, the seeded draw and logprob statistics, each
a pass (or a few, in L2) over a row's logits, with no sort of the vocabulary and no [rows, vocab]
temporaries.

A step that samples 150 rows of Llama-3's 128256 logits with torch ops spends milliseconds in full-
vocabulary sorts, int64 hash tensors and the penalty gathers' temporaries: longer than the decode
forward's own share. Here:
- penalize: vLLM's repetition / frequency / presence penalties from the per-row counts, in place.
- nucleus_floor: each row's top_p cut as a logit threshold, found by searching the threshold, 3
  pivots a pass for 14 passes (FlashInfer's sampling kernels search a pivot alike) over the row's
  probabilities, written once and read from L2.
- draw: the exponential race as a Gumbel-max, argmax over the kept tokens of
  (x - max) / T - log(-log U), U from the hash of (seed, step, token id): a row's token depends
  on its own seed and step only, whatever shares its batch.
- logprob_stats: each row's log-sum-exp and the rank of a token in one pass.

fp8route.engine.sampler holds the same operations in torch (the CPU path and these kernels' oracle).
"""

from __future__ import annotations

import torch

from fp8route.backends.kernels.launcher import DirectLauncher, int_key
from fp8route.backends.kernels.triton_support import TRITON_IMPORT_ERROR, tl, triton

# splitmix64's constants: the seed's, the step's and the token id's multipliers and the finalizer's.
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_CHUNK = 2048
_BLOCK = 2048
_PIVOTS = 4  # a pass narrows the search 4-fold: 14 passes reach 2**-28 of the logits' range
_ROUNDS = 14


def available(x: torch.Tensor) -> bool:
    """Whether the sampler takes the kernels for x: a CUDA tensor, with Triton (tests also call the
    kernels on CPU tensors under Triton's interpreter)."""
    if TRITON_IMPORT_ERROR is not None or torch.compiler.is_compiling():
        return False
    return x.is_cuda


def penalize(
    x: torch.Tensor, where: torch.Tensor, table: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
    factors: torch.Tensor,
) -> None:  # fmt: skip
    """In place on float32 x [R, V]: row where[i] by table row table[i]'s counts (int32) and seen (bool)
    [rows, V], with factors [3, n] = (repetition, frequency, presence)."""
    n, vocab = where.numel(), x.shape[1]
    if n == 0:
        return
    chunks = triton.cdiv(vocab, _CHUNK)
    args = (x, where, table, counts, seen, factors, x.stride(0), counts.stride(0), vocab, n)
    _PENALIZE((n, chunks), (int_key(x.stride(0), counts.stride(0), n), vocab), args, {"CHUNK": _CHUNK, "num_warps": 4})


def nucleus_floor(
    x: torch.Tensor, where: torch.Tensor, top: torch.Tensor, floor: torch.Tensor, temperature: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The lowest logit row where[i] of x keeps under top_p[i], float32 [n]: the tokens at or above
    floor[i] (min_p, top_k), at temperature[i], whose probability mass ahead of them is at most
    top_p[i] (top: each row's maximum)."""
    n, vocab = where.numel(), x.shape[1]
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    if n:
        e = torch.empty((n, vocab), dtype=torch.float32, device=x.device)
        args = (x, where, top, floor, temperature, top_p, e, out, x.stride(0), vocab)
        meta = {"BLOCK": _BLOCK, "PIVOTS": _PIVOTS, "ROUNDS": _ROUNDS, "num_warps": 8}
        _NUCLEUS((n,), (int_key(x.stride(0)), vocab), args, meta)
    return out


def draw(
    x: torch.Tensor, where: torch.Tensor, top: torch.Tensor, floor: torch.Tensor, temperature: torch.Tensor,
    seeds: torch.Tensor, steps: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Row where[i] of x's token, int64 [n]: argmax over x >= floor[i] of
    (x - top[i]) / temperature[i] - log(-log U(seeds[i], steps[i], token))."""
    n, vocab = where.numel(), x.shape[1]
    chunks = triton.cdiv(vocab, _CHUNK)
    keys = torch.empty((n, chunks), dtype=torch.float32, device=x.device)
    ids = torch.empty((n, chunks), dtype=torch.int64, device=x.device)
    if n:
        args = (x, where, top, floor, temperature, seeds, steps, keys, ids, x.stride(0), vocab, chunks)
        _DRAW((n, chunks), (int_key(x.stride(0), chunks), vocab), args, {"CHUNK": _CHUNK, "num_warps": 4})
    return ids.gather(1, keys.argmax(-1, keepdim=True))[:, 0]


def logprob_stats(logits: torch.Tensor, where: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """For row where[i] of logits [R, V] and its token tokens[i]: (log-sum-exp, the token's logit,
    its rank: 1 + the tokens with a larger logit), each [n]."""
    n, vocab = where.numel(), logits.shape[1]
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    own = torch.empty(n, dtype=torch.float32, device=logits.device)
    rank = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        args = (logits, where, tokens, lse, own, rank, logits.stride(0), vocab)
        key = (logits.dtype, int_key(logits.stride(0)), vocab)
        _STATS((n,), key, args, {"BLOCK": _CHUNK, "num_warps": 8})
    return lse, own, rank


if TRITON_IMPORT_ERROR is None:

    @triton.jit
    def uniform(seed, step, ids):
        """U(0, 1) from splitmix64 of seed * GOLDEN + step * MIX2 + id * MIX1 (its top 24 bits)."""
        z = seed.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15
        z += step.to(tl.uint64, bitcast=True) * 0x94D049BB133111EB
        z += ids.to(tl.uint64) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        return ((z >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)

    @triton.jit
    def _penalize_kernel(
        x_ptr, where_ptr, table_ptr, counts_ptr, seen_ptr, factors_ptr, x_stride, table_stride, vocab, n,
        CHUNK: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0)
        offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        inside = offs < vocab
        x_row = x_ptr + tl.load(where_ptr + i) * x_stride
        t = tl.load(table_ptr + i) * table_stride
        count = tl.load(counts_ptr + t + offs, mask=inside, other=0)
        seen = tl.load(seen_ptr + t + offs, mask=inside, other=0) != 0
        appeared = count > 0
        rep = tl.load(factors_ptr + i)
        freq = tl.load(factors_ptr + n + i)
        pres = tl.load(factors_ptr + 2 * n + i)
        x = tl.load(x_row + offs, mask=inside, other=0.0)
        x = tl.where(seen | appeared, tl.where(x > 0, x / rep, x * rep), x)
        x = x - freq * count.to(tl.float32) - pres * appeared.to(tl.float32)
        tl.store(x_row + offs, x, mask=inside)

    @triton.jit
    def _nucleus_kernel(
        x_ptr, where_ptr, top_ptr, floor_ptr, temp_ptr, top_p_ptr, e_ptr, out_ptr, x_stride, vocab,
        BLOCK: tl.constexpr, PIVOTS: tl.constexpr, ROUNDS: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0)
        x_row = x_ptr + tl.load(where_ptr + i) * x_stride
        e_row = e_ptr + i.to(tl.int64) * vocab
        top = tl.load(top_ptr + i)
        floor = tl.load(floor_ptr + i)
        scale = 1.0 / tl.load(temp_ptr + i)
        # Each kept token's unnormalized probability (0 for the others), their mass and the lowest kept logit.
        mass = tl.zeros([BLOCK], dtype=tl.float32)
        low = tl.full([BLOCK], float("inf"), dtype=tl.float32)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < vocab, other=float("-inf"))
            kept = (x >= floor) & (x > float("-inf"))
            e = tl.where(kept, tl.exp((x - top) * scale), 0.0)
            tl.store(e_row + offs, e, mask=offs < vocab)
            mass += e
            low = tl.minimum(low, tl.where(kept, x, float("inf")))
        target = tl.load(top_p_ptr + i) * tl.sum(mass, axis=0)
        # Invariant: the mass above logit hi is at most target, the mass above lo is more. A pass sums the
        # mass above PIVOTS - 1 logits between them (the last pivot is hi), compared as probabilities.
        lo = tl.min(low, axis=0) - 1.0
        hi = top
        steps = tl.arange(0, PIVOTS)
        for _ in range(ROUNDS):
            pivots = lo + (hi - lo) * ((steps + 1).to(tl.float32) / PIVOTS)
            bars = tl.exp((pivots - top) * scale)
            above = tl.zeros([PIVOTS, BLOCK], dtype=tl.float32)
            for start in range(0, vocab, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                e = tl.load(e_row + offs, mask=offs < vocab, other=0.0)
                above += tl.where(e[None, :] > bars[:, None], e[None, :], 0.0)
            small = (tl.sum(above, axis=1) <= target) | (steps == PIVOTS - 1)
            first = tl.min(tl.where(small, steps, PIVOTS), axis=0)
            new_hi = tl.sum(tl.where(steps == first, pivots, 0.0), axis=0)
            lo = tl.where(first > 0, tl.sum(tl.where(steps == first - 1, pivots, 0.0), axis=0), lo)
            hi = tl.where(first == PIVOTS - 1, hi, new_hi)
        tl.store(out_ptr + i, tl.maximum(hi, floor))

    @triton.jit
    def _draw_kernel(
        x_ptr, where_ptr, top_ptr, floor_ptr, temp_ptr, seed_ptr, step_ptr, key_ptr, id_ptr, x_stride, vocab,
        chunks, CHUNK: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0)
        chunk = tl.program_id(1)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + tl.load(where_ptr + i) * x_stride + offs, mask=offs < vocab, other=float("-inf"))
        u = uniform(tl.load(seed_ptr + i), tl.load(step_ptr + i), offs)
        key = (x - tl.load(top_ptr + i)) / tl.load(temp_ptr + i) - tl.log(-tl.log(u))
        key = tl.where((x >= tl.load(floor_ptr + i)) & (x > float("-inf")), key, float("-inf"))
        best, at = tl.max(key, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(key_ptr + i * chunks + chunk, best)
        tl.store(id_ptr + i * chunks + chunk, (chunk * CHUNK + at).to(tl.int64))

    @triton.jit
    def _stats_kernel(x_ptr, where_ptr, token_ptr, lse_ptr, own_ptr, rank_ptr, x_stride, vocab, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        x_row = x_ptr + tl.load(where_ptr + i) * x_stride
        own = tl.load(x_row + tl.load(token_ptr + i)).to(tl.float32)
        top = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        larger = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
            new_top = tl.maximum(top, x)
            safe = tl.where(new_top > float("-inf"), new_top, 0.0)
            total = total * tl.exp(top - safe) + tl.exp(x - safe)
            top = new_top
            larger += (x > own).to(tl.int32)
        row_top = tl.max(top, axis=0)
        safe = tl.where(top > float("-inf"), top, row_top)
        lse = row_top + tl.log(tl.sum(total * tl.exp(safe - row_top), axis=0))
        tl.store(lse_ptr + i, lse)
        tl.store(own_ptr + i, own)
        tl.store(rank_ptr + i, tl.sum(larger, axis=0).to(tl.int64) + 1)

    _PENALIZE = DirectLauncher(_penalize_kernel, pointers=6)
    _NUCLEUS = DirectLauncher(_nucleus_kernel, pointers=8)
    _DRAW = DirectLauncher(_draw_kernel, pointers=9)
    _STATS = DirectLauncher(_stats_kernel, pointers=6)
