"""SamplingParams (vLLM's names and defaults) and the engine's one sampler.

Each request samples from its own stream: the noise for a request's t-th token is a hash of
(its seed, t, token id), so the tokens it draws do not depend on which other requests share its
batch, and a seed reproduces them exactly. Drawn as the exponential race argmax(p / E), E = -log U,
with no op that waits on the host: every per-row value reaches the device from pinned memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fp8route.engine.argmax import greedy_tokens
from fp8route.engine.kv_pool import upload
from fp8route.errors import Fp8InputError

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


# splitmix64's constants, as the signed int64 torch holds.
_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops. temperature 0 is greedy."""

    max_tokens: int | None = 16  # None: until the model's context is full
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop ids are masked until this many tokens came

    def __post_init__(self) -> None:
        def fail(message: str) -> None:
            raise Fp8InputError(f"SamplingParams: {message}")

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail(f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}")
        if (
            not isinstance(self.temperature, (int, float))
            or not 0 <= self.temperature <= 100
            or math.isnan(self.temperature)
        ):
            fail(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            fail(f"seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not all(isinstance(i, int) and i >= 0 for i in ids):
            fail(f"stop_token_ids must be a list of token ids >= 0, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0, 1) [B, vocab] from a counter hash of (seed, step, token id) per row (int64 ops wrap)."""
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * _GOLDEN + steps[:, None] * _MIX2 + ids[None, :] * _MIX1
    for shift, mult in ((30, _MIX1), (27, _MIX2)):  # splitmix64's finalizer (logical shifts)
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * mult
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    mantissa = (x >> 11) & ((1 << 53) - 1)
    return (mantissa.double() + 0.5) / float(1 << 53)


def choose(
    logits: torch.Tensor,
    greedy: torch.Tensor | None,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    steps: Sequence[int],
    eos_token_ids: Sequence[int],
) -> torch.Tensor:
    """Each row's next token: row i of logits [R, vocab] chooses its request's steps[i]-th output
    token with params[i] from the stream of seeds[i]. greedy: the rows' argmax when the forward
    computed it. Before min_tokens, EOS (unless ignored) and the stop ids are held back."""
    masked = [i for i, (p, t) in enumerate(zip(params, steps, strict=True)) if t < p.min_tokens]
    if not masked and all(p.greedy for p in params):
        return greedy if greedy is not None else greedy_tokens(logits)
    if masked:
        banned = [[*(() if params[i].ignore_eos else eos_token_ids), *params[i].stop_token_ids] for i in masked]
        logits = mask_tokens(logits, masked, banned)
    return sample(logits, [p.temperature for p in params], [p.top_p for p in params], seeds, steps)


def sample(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    seeds: Sequence[int],
    steps: Sequence[int],
) -> torch.Tensor:
    """One token per row of logits [B, vocab]: argmax where the temperature is 0, else drawn from
    softmax(logits / temperature) cut to its top_p nucleus with the row's (seed, step) stream."""
    greedy = greedy_tokens(logits)
    sampled = [i for i, t in enumerate(temperatures) if t > 0]
    if not sampled:
        return greedy
    device = logits.device
    ints = upload(torch.tensor([sampled, [_signed(seeds[i]) for i in sampled], [steps[i] for i in sampled]]), device)
    index, seed_t, step_t = ints
    floats = upload(torch.tensor([[temperatures[i] for i in sampled], [top_ps[i] for i in sampled]]), device)
    temps, cut = floats[0], floats[1]
    probs = torch.softmax(logits[index].float() / temps[:, None], dim=-1)
    if any(top_ps[i] < 1.0 for i in sampled):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p; the most likely token always stays.
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p > cut[:, None], 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    noise = -torch.log(_uniform(seed_t, step_t, logits.shape[-1]))
    chosen = (probs.double() / noise).argmax(dim=-1)
    return greedy.index_copy(0, index, chosen)


def mask_tokens(logits: torch.Tensor, rows: Sequence[int], banned: Sequence[Sequence[int]]) -> torch.Tensor:
    """logits with banned[i]'s ids at -inf in row rows[i] (EOS and stop ids before min_tokens)."""
    pairs = [(r, t) for r, ids in zip(rows, banned, strict=True) for t in ids if t < logits.shape[-1]]
    if not pairs:
        return logits
    logits = logits.clone()
    where = upload(torch.tensor(pairs).T.contiguous(), logits.device)
    logits[where[0], where[1]] = float("-inf")
    return logits
