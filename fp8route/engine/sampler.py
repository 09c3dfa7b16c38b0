"""The engine's one sampler: every sampled row of a step chooses its next token in one batch of GPU
ops, whatever mix of SamplingParams the rows carry.

A row's logits are processed in SamplingParams' order (bias, min_tokens, penalties, structured
output, temperature, min_p, top_k, top_p); each op runs on the rows that need it only, so a step of
plain requests pays for none of them. min_p and top_p become one floor per row, the lowest logit it
keeps; a top_k row keeps exactly its k largest logits (the lower id first among equal ones) and draws
among them. On CUDA the ops are fp8route.kernels.sampling's kernels; the torch ops here are the CPU
path and their oracle (they sort a top_p row's vocabulary). The per-row values reach the device from
pinned memory and nothing waits for the GPU.

Each request samples from its own stream: the noise for a request's t-th token is a hash of (its
seed, t, token id), so the tokens it draws do not depend on which other requests share its batch,
and a seed reproduces them exactly. Drawn as a Gumbel-max, argmax((x - max) / T - log(-log U)).

Penalties need the tokens each request saw. They are kept on the device, as counts per table row
[rows, vocab] (made on the first penalized request): seeded from the prompt and the output when a
request takes its row, then counted up from the sampled tokens themselves, so no step sends a
request's history again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from fp8route.engine.kv_pool import upload, upload_parts
from fp8route.engine.request import TokenLogprobs
from fp8route.engine.sampling import MAX_LOGPROBS, SamplingParams
from fp8route.kernels import sampling as kernels
from fp8route.kernels.argmax import greedy_tokens

WARM_TOP_K = 256  # warm_up compiles the top_k kernels up to this k; a larger one compiles its class on first use
_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


# splitmix64's constants, as the signed int64 torch holds.
_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (kernels.GOLDEN, kernels.MIX1, kernels.MIX2))


class Draw(NamedTuple):
    """One row to sample: its request's params and seed, and which output token it chooses (0 for the
    first: the seeded stream's step, and whether min_tokens still holds)."""

    params: SamplingParams
    seed: int
    step: int


@dataclass
class Logprobs:
    """TokenLogprobs for some rows, on the device until read back: rows[i] (an index into the rows
    they were computed for) keeps its top ks[i]."""

    rows: list[int]
    ks: list[int]
    token: torch.Tensor  # int64 [L]
    logprob: torch.Tensor  # float32 [L]
    rank: torch.Tensor  # int64 [L]
    top_ids: torch.Tensor  # int64 [L, K]
    top_logprobs: torch.Tensor  # float32 [L, K]

    def tensors(self) -> list[torch.Tensor]:
        return [self.token, self.logprob, self.rank, self.top_ids, self.top_logprobs]

    @staticmethod
    def read(host: Sequence[torch.Tensor], ks: Sequence[int]) -> list[TokenLogprobs]:
        """Host copies of tensors() as one TokenLogprobs per row."""
        token, logprob, rank, top_ids, top_logprobs = (t.tolist() for t in host)
        return [
            TokenLogprobs(token[i], logprob[i], rank[i], tuple(top_ids[i][:k]), tuple(top_logprobs[i][:k]))
            for i, k in enumerate(ks)
        ]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[torch.Tensor]:
    """For logits [L, vocab] and tokens [L]: each token's log-probability, its rank, and the top k
    (ids, log-probabilities): Logprobs' tensors but rows and ks."""
    every = torch.arange(len(tokens), device=logits.device)
    if kernels.available(logits):
        lse, own, rank = kernels.logprob_stats(logits, every, tokens)
    else:
        x = logits.float()
        lse = torch.logsumexp(x, dim=-1)
        own = x.gather(1, tokens[:, None])[:, 0]
        rank = (x > own[:, None]).sum(-1) + 1
    if k:
        values, ids = _top(logits, every, k)
    else:
        values, ids = logits[:, :0].float(), tokens[:, None][:, :0]
    return [tokens, own - lse, rank, ids, values - lse[:, None]]


def _top(x: torch.Tensor, where: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows where of x: their k largest values (float32) and ids, highest first, the lower id first
    among equal values (a stable sort on the CPU, and for a k beyond the kernels' candidates)."""
    if kernels.available(x) and k <= kernels.MAX_CANDIDATES:
        return kernels.top_candidates(x, where, k)
    ordered = x.index_select(0, where).float().sort(dim=-1, descending=True, stable=True)
    return ordered.values[:, :k], ordered.indices[:, :k]


class Sampler:
    def __init__(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        """max_rows: the table rows (the padding row included) whose penalty counts it may keep."""
        self.vocab_size, self.max_rows, self.device = vocab_size, max_rows, device
        self.counts: torch.Tensor | None = None  # int32 [rows, vocab]: each row's output tokens
        self.seen: torch.Tensor | None = None  # bool [rows, vocab]: each row's prompt tokens

    def admit(self, row: int, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """A penalized request takes table row `row` (it is readmitted after a preemption with its
        output so far): the row's counts start from what the request has seen."""
        if self.counts is None or self.seen is None:
            self.counts = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.int32, device=self.device)
            self.seen = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.bool, device=self.device)
        prompt = upload(torch.tensor(prompt_token_ids, dtype=torch.int64), self.device)
        self.seen[row].zero_()
        self.seen[row].index_fill_(0, prompt, True)
        self.counts[row].zero_()
        if output_token_ids:
            ids = upload(torch.tensor(output_token_ids, dtype=torch.int64), self.device)
            self.counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def warm_up(self, dtype: torch.dtype, eos_token_ids: Sequence[int]) -> None:
        """Sample every kind of row once on dummy logits of this dtype, so that Triton compiles each of
        the kernels' variants now and not in a step that a load waits on: greedy and drawn rows,
        penalties or none, a bias and min_tokens, a grammar's mask, either count of logprobs, min_p,
        top_p, and top_k of each size class up to WARM_TOP_K."""
        sampled: dict[str, Any] = {"temperature": 0.8, "max_tokens": 2}
        plain = [SamplingParams(temperature=0, max_tokens=2), SamplingParams(**sampled, min_p=0.1),
                 SamplingParams(**sampled, top_p=0.9, logprobs=1)]  # fmt: skip
        penalized = SamplingParams(**sampled, repetition_penalty=1.1, logprobs=MAX_LOGPROBS)
        held = SamplingParams(**sampled, min_tokens=2, logit_bias={0: 1.0})  # the logits copied to float32 first
        kinds = [[plain[0]], plain, [*plain, penalized], [*plain, held], [*plain, penalized, held]]
        k = 1
        while k <= WARM_TOP_K:
            kinds.append([SamplingParams(**sampled, top_k=k, top_p=0.9)])
            k = 2 * kernels.size_class(k)
        had_counts = self.counts is not None
        logits = torch.randn(max(map(len, kinds)), self.vocab_size, dtype=dtype, device=self.device)
        bitmask = torch.full((1, -(-self.vocab_size // 32)), -1, dtype=torch.int32, device=self.device)
        for masks in (None, ([0], bitmask)):
            for params in kinds if masks is None else [plain]:
                # Each choosing its first output token, as a prefill's last chunk does.
                for row, p in enumerate(params):
                    if p.penalized:
                        self.admit(row % self.max_rows, [0], [])
                rows = torch.arange(len(params), device=self.device) % self.max_rows
                self(logits[: len(params)], None, [Draw(p, 0, 0) for p in params], rows, eos_token_ids, masks)
        if not had_counts:  # a server of plain requests keeps no penalty counts
            self.counts = self.seen = None

    def __call__(
        self,
        logits: torch.Tensor,
        greedy: torch.Tensor | None,
        draws: Sequence[Draw],
        rows: torch.Tensor,
        eos_token_ids: Sequence[int],
        masks: tuple[list[int], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, Logprobs | None]:
        """Row i of logits [R, vocab] makes draws[i]; rows: their table rows on the device; greedy: the
        rows' argmax when the forward computed it; masks: (the rows a grammar constrains, their
        bitmasks on the device). -> (tokens [R], the rows' Logprobs if any asked)."""
        params = [d.params for d in draws]
        steps = [d.step for d in draws]
        held = {  # the rows before their min_tokens: the ids they may not draw yet
            i: [*(() if p.ignore_eos else eos_token_ids), *p.stop_token_ids]
            for i, (p, t) in enumerate(zip(params, steps, strict=True))
            if t < p.min_tokens
        }
        penalized = [i for i, p in enumerate(params) if p.penalized]
        if masks is None and not held and all(p.greedy and p.plain for p in params):
            tokens = greedy if greedy is not None else greedy_tokens(logits)
        else:
            x, top = self._process(logits, params, rows, held, bool(penalized), masks)
            tokens = _draw(x, top, params, [d.seed for d in draws], steps)
        counted = upload(torch.tensor(penalized), self.device) if penalized else None
        if counted is not None and self.counts is not None:
            self.counts.index_put_((rows[counted], tokens[counted]), torch.ones_like(counted, dtype=torch.int32), True)
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not asked:
            return tokens, None
        ks = [params[i].logprobs or 0 for i in asked]
        if len(asked) == len(params):
            return tokens, Logprobs(asked, ks, *token_logprobs(logits, tokens, max(ks)))
        where = upload(torch.tensor(asked), self.device)
        return tokens, Logprobs(asked, ks, *token_logprobs(logits[where], tokens[where], max(ks)))

    def _process(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], rows: torch.Tensor,
        held: dict[int, list[int]], penalized: bool, masks: tuple[list[int], torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The logits biased, held back (held: row -> its banned ids), penalized and masked, as float32;
        and each row's maximum of them."""
        x = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        source = logits
        if held or any(p.logit_bias for p in params):
            x.copy_(logits)
            self._bias(x, params)
            _mask_tokens(x, list(held), list(held.values()))
            source = x
        factors = self._factors(params) if penalized else None
        top = None
        if kernels.available(x):
            top = kernels.process(source, x, rows, self.counts, self.seen, factors)
        else:
            if source is not x:
                x.copy_(source)
            if factors is not None:
                self._penalize(x, rows, factors)
        if masks is not None:
            where = upload(torch.tensor(masks[0]), self.device)
            if kernels.available(x):
                kernels.apply_bitmask_(x, where, masks[1])
            else:
                from fp8route.engine.structured import apply_bitmask

                x[where] = apply_bitmask(x[where], masks[1])
            top = None
        return x, x.amax(dim=-1) if top is None else top

    def _factors(self, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Each row's (repetition, frequency, presence) penalties, float32 [3, R] on the device; a row
        without penalties (1, 0, 0), which leave it as it is."""
        assert self.counts is not None and self.seen is not None, "a penalized request took its row unseen"
        factors = [[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                   [p.presence_penalty for p in params]]  # fmt: skip
        return upload(torch.tensor(factors, dtype=torch.float32), self.device)

    def _penalize(self, x: torch.Tensor, rows: torch.Tensor, factors: torch.Tensor) -> None:
        """vLLM's penalties on every row of x (the torch path of kernels.process): repetition divides a
        seen token's positive logit (multiplies a negative one); frequency subtracts per output
        occurrence, presence once."""
        assert self.counts is not None and self.seen is not None
        rep, freq, pres = factors[:, :, None]
        counts = self.counts[rows]
        appeared = counts > 0
        seen = self.seen[rows] | appeared
        x.copy_(torch.where(seen, torch.where(x > 0, x / rep, x * rep), x) - freq * counts - pres * appeared)

    def _bias(self, x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
        vocab = x.shape[-1]
        triples = [
            (i, t, v) for i, p in enumerate(params) if p.logit_bias for t, v in p.logit_bias.items() if t < vocab
        ]
        if not triples:
            return
        rows, tokens, values = zip(*triples, strict=True)
        where = upload(torch.tensor([rows, tokens]), self.device)
        x.index_put_((where[0], where[1]), upload(torch.tensor(values), self.device), accumulate=True)


def _mask_tokens(x: torch.Tensor, rows: Sequence[int], banned: Sequence[Sequence[int]]) -> None:
    """banned[i]'s ids to -inf in row rows[i] (EOS and stop ids before min_tokens)."""
    pairs = [(r, t) for r, ids in zip(rows, banned, strict=True) for t in ids if t < x.shape[-1]]
    if pairs:
        where = upload(torch.tensor(pairs).T.contiguous(), x.device)
        x[where[0], where[1]] = float("-inf")


@dataclass
class _Draws:
    """The sampled rows of a step and their controls, on the device: one upload of each kind."""

    params: list[SamplingParams]
    where: torch.Tensor  # int64 [n]: the rows of x
    seeds: torch.Tensor  # int64 [n]
    steps: torch.Tensor  # int64 [n]
    top_k: torch.Tensor  # int64 [n]: 0 for none
    temperature: torch.Tensor  # float32 [n]
    log_min_p: torch.Tensor  # float32 [n]: -inf for none
    top_p: torch.Tensor  # float32 [n]

    @staticmethod
    def of(
        rows: list[int], params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int], vocab: int,
        device: torch.device,
    ) -> _Draws:  # fmt: skip
        chosen = [params[i] for i in rows]
        ints = np.array([rows, [_signed(seeds[i]) for i in rows], [steps[i] for i in rows],
                         [min(p.top_k, vocab) for p in chosen]], dtype=np.int64)  # fmt: skip
        floats = np.array([[p.temperature for p in chosen],
                           [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in chosen],
                           [p.top_p for p in chosen]], dtype=np.float32)  # fmt: skip
        # Aligned rows: a row count of another parity would otherwise compile kernels in the middle of a load.
        return _Draws(chosen, *upload_parts(list(ints), device), *upload_parts(list(floats), device))


def _draw(
    x: torch.Tensor, top: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]
) -> torch.Tensor:
    """One token per row of processed logits x [R, vocab] (top: each row's maximum): the argmax where
    the temperature is 0, else drawn after temperature, min_p, top_k and top_p from the row's (seed,
    step) stream: a top_k row among its k candidates, another over its whole row."""
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if len(sampled) < len(params):
        tokens = greedy_tokens(x)
    else:
        tokens = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    if not sampled:
        return tokens
    d = _Draws.of(sampled, params, seeds, steps, x.shape[-1], x.device)
    top = top[d.where]
    floor = top + d.temperature * d.log_min_p  # min_p: p_i >= min_p * p_max, as logits
    with_k = [j for j, p in enumerate(d.params) if p.top_k > 0]
    if len(with_k) < len(d.params):
        chosen = _draw_rows(x, d, top, floor)
    else:
        chosen = torch.empty(len(sampled), dtype=torch.int64, device=x.device)
    if with_k:
        k = upload(torch.tensor(with_k), x.device)
        most = min(max(d.params[j].top_k for j in with_k), x.shape[-1])
        chosen.index_copy_(0, k, _draw_top_k(x, d, k, most, top, floor))
    return tokens.index_copy(0, d.where, chosen)


def _draw_rows(x: torch.Tensor, d: _Draws, top: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """The token of each row of d without top_k, drawn over its whole row above floor raised to its
    top_p cut (a threshold search on CUDA, a sort of the row here); a top_k row's is left undefined."""
    nucleus = [j for j, p in enumerate(d.params) if p.top_k == 0 and p.top_p < 1]
    if nucleus:
        n = upload(torch.tensor(nucleus), x.device)
        args = (top[n], floor[n], d.temperature[n], d.top_p[n])
        if kernels.available(x):
            floor[n] = kernels.nucleus_floor(x, d.where[n], *args)
        else:
            floor[n] = _nucleus(x[d.where[n]].sort(dim=-1, descending=True).values, *args)
    if kernels.available(x):
        return kernels.draw(x, d.where, top, floor, d.temperature, d.seeds, d.steps, d.top_k)
    ids = torch.arange(x.shape[-1], device=x.device)[None]
    return _draw_among(x[d.where], ids, top, floor, d.temperature, d.seeds, d.steps)


def _draw_top_k(
    x: torch.Tensor, d: _Draws, k: torch.Tensor, most: int, top: torch.Tensor, floor: torch.Tensor
) -> torch.Tensor:
    """The token of rows k of d (each with a top_k, most the largest; top and floor: every row of
    d's), drawn among their top_k candidates (the lower id first among equal logits) above floor
    raised to the top_p cut of their mass: one kernel on CUDA."""
    values, ids = _top(x, d.where[k], most)
    args = (values, ids, k, top, floor, d.temperature, d.top_p, d.top_k, d.seeds, d.steps)
    return kernels.draw_top_k(*args) if kernels.available(values) else _draw_top_k_rows(*args)


def _draw_top_k_rows(
    values: torch.Tensor, ids: torch.Tensor, k: torch.Tensor, top: torch.Tensor, floor: torch.Tensor,
    temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """kernels.draw_top_k in torch: row i's candidates values[i] (ids[i]) are those of row k[i] of
    the other tensors."""
    top, temperature, top_k = top[k], temperature[k], top_k[k]
    values = values.masked_fill(torch.arange(values.shape[1], device=values.device) >= top_k[:, None], -math.inf)
    kth = values.gather(1, (top_k - 1)[:, None])[:, 0]
    floor = _nucleus(values, top, torch.maximum(floor[k], kth), temperature, top_p[k])
    return _draw_among(values, ids, top, floor, temperature, seeds[k], steps[k])


def _draw_among(
    values: torch.Tensor, ids: torch.Tensor, top: torch.Tensor, floor: torch.Tensor, temperature: torch.Tensor,
    seeds: torch.Tensor, steps: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Row i's token: the Gumbel-max over its logits values[i] >= floor[i] (their token ids ids[i],
    or one row of ids for every row), argmax of (value - top) / temperature - log(-log U(seed, step, id))."""
    keys = (values - top[:, None]) / temperature[:, None] - torch.log(-torch.log(_uniform(seeds, steps, ids)))
    keys = keys.masked_fill(~((values >= floor[:, None]) & (values > -math.inf)), -math.inf)
    at = keys.argmax(dim=-1, keepdim=True)
    return ids.expand(len(values), -1).gather(1, at)[:, 0]


def _nucleus(
    ordered: torch.Tensor, top: torch.Tensor, floor: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """floor raised to top_p's cut, for rows whose logits (or their candidates) are `ordered`, highest
    first: the lowest kept logit whose probability mass ahead of it is at most top_p (of the mass at
    or above floor)."""
    kept = ordered >= floor[:, None]
    e = torch.where(kept, torch.exp((ordered - top[:, None]) / temperature[:, None]), 0.0)
    ahead = e.cumsum(dim=-1) - e
    inside = kept & (ahead <= top_p[:, None] * e.sum(dim=-1, keepdim=True))
    return torch.where(inside, ordered, math.inf).amin(dim=-1)


def _uniform(seeds: torch.Tensor, steps: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """U(0, 1) float32 [B, V] for token ids [B, V] (or [1, V] for every row) from a counter hash of
    (seed, step) per row and the token id, as fp8route.kernels.sampling.uniform has it (int64 ops
    wrap; 32-bit values are kept masked)."""
    z = seeds * _GOLDEN + steps * _MIX2
    for shift, mult in ((30, _MIX1), (27, _MIX2)):  # splitmix64's finalizer (logical shifts)
        z = (z ^ ((z >> shift) & ((1 << (64 - shift)) - 1))) * mult
    z = z ^ ((z >> 31) & ((1 << 33) - 1))
    h = _fmix32(((ids * kernels.ID_MUL) & _MASK32) ^ (z[:, None] & _MASK32))
    h = _fmix32(h ^ ((z[:, None] >> 32) & _MASK32))
    return ((h >> 8).float() + 0.5) / float(1 << 24)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on uint32 values held in int64."""
    h = h ^ (h >> 16)
    h = (h * kernels.FMIX1) & _MASK32
    h = h ^ (h >> 13)
    h = (h * kernels.FMIX2) & _MASK32
    return h ^ (h >> 16)
