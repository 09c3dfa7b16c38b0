"""The engine's one sampler: every sampled row of a step chooses its next token in one batch of GPU
ops, whatever mix of SamplingParams the rows carry.

A row's logits are processed in SamplingParams' order (bias, min_tokens, penalties, structured
output, temperature, min_p, top_k, top_p); each op runs on the rows that need it only, so a step of
plain requests pays for none of them and only the rows with top_p < 1 sort their vocabulary. The
per-row values reach the device from pinned memory and nothing waits for the GPU.

Each request samples from its own stream: the noise for a request's t-th token is a hash of (its
seed, t, token id), so the tokens it draws do not depend on which other requests share its batch,
and a seed reproduces them exactly. Drawn as the exponential race argmax(p / E), E = -log U.

Penalties need the tokens each request saw. They are kept on the device, as counts per table row
[rows, vocab] (made on the first penalized request): seeded from the prompt and the output when a
request takes its row, then counted up from the sampled tokens themselves, so no step sends a
request's history again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fp8route.engine.kv_pool import upload
from fp8route.engine.request import Request, TokenLogprobs
from fp8route.engine.sampling import SamplingParams
from fp8route.kernels.argmax import greedy_tokens

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


# splitmix64's constants, as the signed int64 torch holds.
_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


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
            TokenLogprobs(token[i], logprob[i], rank[i], top_ids[i][:k], top_logprobs[i][:k]) for i, k in enumerate(ks)
        ]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[torch.Tensor]:
    """For logits [L, vocab] and tokens [L]: each token's log-probability, its rank, and the top k
    (ids, log-probabilities): Logprobs' tensors but rows and ks."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    own = lp.gather(1, tokens[:, None])[:, 0]
    rank = (lp > own[:, None]).sum(-1) + 1
    values, ids = lp.topk(k, dim=-1) if k else (lp[:, :0], tokens[:, None][:, :0])
    return [tokens, own, rank, ids, values]


class Sampler:
    def __init__(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        """max_rows: the table rows (the padding row included) whose penalty counts it may keep."""
        self.vocab_size, self.max_rows, self.device = vocab_size, max_rows, device
        self.counts: torch.Tensor | None = None  # int32 [rows, vocab]: each row's output tokens
        self.seen: torch.Tensor | None = None  # bool [rows, vocab]: each row's prompt tokens

    def admit(self, row: int, request: Request) -> None:
        """A penalized request takes table row `row` (it is readmitted after a preemption with its
        output so far): the row's counts start from what the request has seen."""
        if self.counts is None or self.seen is None:
            self.counts = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.int32, device=self.device)
            self.seen = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.bool, device=self.device)
        prompt = upload(torch.tensor(request.prompt_token_ids, dtype=torch.int64), self.device)
        self.seen[row].zero_()
        self.seen[row].index_fill_(0, prompt, True)
        self.counts[row].zero_()
        output = request.output_token_ids
        if output:
            ids = upload(torch.tensor(output, dtype=torch.int64), self.device)
            self.counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def __call__(
        self,
        logits: torch.Tensor,
        greedy: torch.Tensor | None,
        requests: Sequence[Request],
        rows: torch.Tensor,
        eos_token_ids: Sequence[int],
        masks: tuple[list[int], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, Logprobs | None]:
        """Row i of logits [R, vocab] chooses requests[i]'s next token; rows: their table rows on the
        device; greedy: the rows' argmax when the forward computed it; masks: (the rows a grammar
        constrains, their bitmasks on the device). -> (tokens [R], the rows' Logprobs if any asked)."""
        params = [r.params for r in requests]
        steps = [r.num_output_scheduled - 1 for r in requests]  # each request's output token being chosen
        held = [i for i, (p, t) in enumerate(zip(params, steps, strict=True)) if t < p.min_tokens]
        penalized = [i for i, p in enumerate(params) if p.penalized]
        counted = upload(torch.tensor(penalized), self.device) if penalized else None
        if masks is None and not held and all(p.greedy and p.plain for p in params):
            tokens = greedy if greedy is not None else greedy_tokens(logits)
        else:
            x = logits.to(torch.float32, copy=True)
            self._bias(x, params)
            if held:
                banned = [[*(() if params[i].ignore_eos else eos_token_ids), *params[i].stop_token_ids] for i in held]
                _mask_tokens(x, held, banned)
            if counted is not None:
                self._penalize(x, counted, rows, [params[i] for i in penalized])
            if masks is not None:
                from fp8route.engine.structured import apply_bitmask

                where = upload(torch.tensor(masks[0]), self.device)
                x[where] = apply_bitmask(x[where], masks[1])
            tokens = _draw(x, params, [r.seed for r in requests], steps)
        if counted is not None and self.counts is not None:
            self.counts.index_put_((rows[counted], tokens[counted]), torch.ones_like(counted, dtype=torch.int32), True)
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not asked:
            return tokens, None
        ks = [params[i].logprobs or 0 for i in asked]
        where = upload(torch.tensor(asked), self.device)
        return tokens, Logprobs(asked, ks, *token_logprobs(logits[where], tokens[where], max(ks)))

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

    def _penalize(
        self, x: torch.Tensor, where: torch.Tensor, rows: torch.Tensor, params: Sequence[SamplingParams]
    ) -> None:
        """vLLM's penalties on the rows `where` (their params in order): repetition divides a seen
        token's positive logit (multiplies a negative one); frequency subtracts per output occurrence,
        presence once."""
        assert self.counts is not None and self.seen is not None, "a penalized request took its row unseen"
        factors = [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params]
        rep, freq, pres = upload(torch.tensor(factors, dtype=torch.float32).T.contiguous(), self.device)
        counts = self.counts[rows[where]]
        appeared = counts > 0
        seen = self.seen[rows[where]] | appeared
        rows_x = x[where]
        rep = rep[:, None]
        rows_x = torch.where(seen, torch.where(rows_x > 0, rows_x / rep, rows_x * rep), rows_x)
        rows_x = rows_x - freq[:, None] * counts - pres[:, None] * appeared
        x[where] = rows_x


def _mask_tokens(x: torch.Tensor, rows: Sequence[int], banned: Sequence[Sequence[int]]) -> None:
    """banned[i]'s ids to -inf in row rows[i] (EOS and stop ids before min_tokens)."""
    pairs = [(r, t) for r, ids in zip(rows, banned, strict=True) for t in ids if t < x.shape[-1]]
    if pairs:
        where = upload(torch.tensor(pairs).T.contiguous(), x.device)
        x[where[0], where[1]] = float("-inf")


def _draw(
    x: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]
) -> torch.Tensor:
    """One token per row of processed logits x [R, vocab]: the argmax where the temperature is 0,
    else drawn after temperature, min_p, top_k and top_p from the row's (seed, step) stream."""
    tokens = greedy_tokens(x)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens
    device, vocab = x.device, x.shape[-1]
    chosen = [params[i] for i in sampled]
    ints = upload(
        torch.tensor([sampled, [_signed(seeds[i]) for i in sampled], [steps[i] for i in sampled],
                      [min(p.top_k, vocab) for p in chosen]]),
        device,
    )  # fmt: skip
    index, seed_t, step_t, top_k = ints
    floats = [[p.temperature for p in chosen], [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in chosen]]
    temps, log_min_p = upload(torch.tensor(floats, dtype=torch.float32), device)
    logits = x[index] / temps[:, None]
    if any(p.min_p > 0 for p in chosen):  # p_i < min_p * p_max, as logits
        logits = logits.masked_fill(logits < logits.amax(-1, keepdim=True) + log_min_p[:, None], float("-inf"))
    if any(p.top_k > 0 for p in chosen):
        most = min(max(p.top_k for p in chosen), vocab)
        kth = logits.topk(most, dim=-1).values.gather(1, (top_k.clamp(1, most) - 1)[:, None])
        kth = torch.where(top_k[:, None] > 0, kth, float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    nucleus = [j for j, p in enumerate(chosen) if p.top_p < 1]
    if nucleus:
        probs = _top_p(probs, nucleus, [chosen[j].top_p for j in nucleus])
    noise = -torch.log(_uniform(seed_t, step_t, vocab))
    return tokens.index_copy(0, index, (probs.double() / noise).argmax(dim=-1))


def _top_p(probs: torch.Tensor, rows: list[int], top_ps: list[float]) -> torch.Tensor:
    """probs with rows[i] cut to the smallest prefix of its sorted probabilities whose mass reaches
    top_ps[i] (the most likely token always stays): the only sort of the vocabulary."""
    device = probs.device
    where = upload(torch.tensor(rows), device)
    cut = upload(torch.tensor(top_ps, dtype=torch.float32), device)
    sorted_p, order = probs[where].sort(dim=-1, descending=True)
    sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p > cut[:, None], 0.0)
    return probs.index_copy(0, where, torch.zeros_like(sorted_p).scatter_(-1, order, sorted_p))


def _uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0, 1) [B, vocab] from a counter hash of (seed, step, token id) per row (int64 ops wrap)."""
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * _GOLDEN + steps[:, None] * _MIX2 + ids[None, :] * _MIX1
    for shift, mult in ((30, _MIX1), (27, _MIX2)):  # splitmix64's finalizer (logical shifts)
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * mult
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    mantissa = (x >> 11) & ((1 << 53) - 1)
    return (mantissa.double() + 0.5) / float(1 << 53)
