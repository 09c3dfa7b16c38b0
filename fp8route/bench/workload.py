"""A serving benchmark's load and its report, the same for the offline engine and for any
OpenAI-compatible server over HTTP: random prompts (optionally behind a shared prefix), output
lengths, Poisson or all-at-once arrivals; and per request its TTFT, inter-token latencies and end
to end time, summarized under the names SGLang's and vLLM's serving benchmarks use.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from fp8route.errors import Fp8InputError


def parse_range(text: str, name: str) -> tuple[int, int]:
    """'A:B' (or 'A') -> (A, B) with 1 <= A <= B."""
    try:
        low, _, high = text.partition(":")
        bounds = int(low), int(high or low)
    except ValueError:
        raise Fp8InputError(f"{name}: expected A:B (two integers), got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise Fp8InputError(f"{name}: expected 1 <= A <= B, got {text!r}")
    return bounds


def parse_rate(text: str) -> float:
    """Requests per second: a positive number, or 'inf' (every request arrives at once)."""
    try:
        rate = float(text)
    except ValueError:
        raise Fp8InputError(f"--request-rate: a number of requests per second or inf, got {text!r}") from None
    if not rate > 0:
        raise Fp8InputError(f"--request-rate must be positive (or inf), got {text!r}")
    return rate


@dataclass(frozen=True)
class LoadRequest:
    prompt_ids: list[int]
    output_len: int
    arrival_s: float  # after the run starts


def make_load(
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab: int,
    *,
    request_rate: float = float("inf"),
    shared_prefix: int = 0,
    seed: int = 0,
    special_ids: Sequence[int] = (),
) -> list[LoadRequest]:
    """num_prompts requests of uniform random lengths and random token ids (special ids left out,
    so a tokenizer round trip keeps them), each prompt `shared_prefix` common tokens then its own."""
    if num_prompts < 1:
        raise Fp8InputError(f"--num-prompts must be at least 1, got {num_prompts}")
    rng = random.Random(seed)
    banned = set(special_ids)
    tokens = [t for t in range(min(vocab, 1 << 20)) if t not in banned]
    prefix = [rng.choice(tokens) for _ in range(shared_prefix)]
    clock, load = 0.0, []
    for _ in range(num_prompts):
        own = rng.randint(*input_len)
        ids = prefix + [rng.choice(tokens) for _ in range(own)]
        if request_rate != float("inf"):
            clock += rng.expovariate(request_rate)
        load.append(LoadRequest(ids, rng.randint(*output_len), clock))
    return load


@dataclass
class RequestResult:
    input_tokens: int
    output_tokens: int
    expected_tokens: int  # what the load asked for (ignore_eos): anything less was cut short
    ttft_s: float
    e2e_s: float
    itl_s: list[float] = field(default_factory=list)  # between consecutive tokens
    error: str = ""
    cached_tokens: int = 0

    @property
    def ok(self) -> bool:
        return not self.error and self.output_tokens == self.expected_tokens


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]

    return {"mean": statistics.fmean(ordered), "p50": at(0.5), "p99": at(0.99)}


@dataclass
class ServeReport:
    arm: str
    completed: int
    failed: int  # errored or cut short: every one is a bug or an overload the run must explain
    duration_s: float
    request_throughput: float
    input_throughput: float  # prompt tokens per second, cached ones included (as SGLang counts)
    output_throughput: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    cached_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # what a driver measured besides

    def to_json(self) -> dict[str, object]:
        def rounded(value: object) -> object:
            if isinstance(value, float):
                return round(value, 4)
            if isinstance(value, dict):
                return {k: rounded(v) for k, v in value.items()}
            return value

        return {k: rounded(v) for k, v in asdict(self).items()}


def summarize(arm: str, results: Sequence[RequestResult], duration_s: float, **extra: object) -> ServeReport:
    good = [r for r in results if r.ok]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]

    def scaled(values: Sequence[float]) -> dict[str, float]:  # seconds -> ms
        return {k: v * 1e3 for k, v in _percentiles(values).items()}

    return ServeReport(
        arm=arm,
        completed=len(good),
        failed=len(results) - len(good),
        duration_s=duration_s,
        request_throughput=len(good) / duration_s,
        input_throughput=sum(r.input_tokens for r in good) / duration_s,
        output_throughput=sum(r.output_tokens for r in good) / duration_s,
        ttft_ms=scaled([r.ttft_s for r in good]),
        tpot_ms=scaled(tpot),
        itl_ms=scaled([x for r in good for x in r.itl_s]),
        e2e_ms=scaled([r.e2e_s for r in good]),
        cached_tokens=sum(r.cached_tokens for r in good),
        extra=dict(extra),
    )


def table(reports: Sequence[ServeReport]) -> str:
    return "\n".join([table_header(), *(table_row(r) for r in reports)])


def table_header() -> str:
    return (
        f"{'arm':<24}{'done':>6}{'fail':>5}{'req/s':>8}{'in tok/s':>10}{'out tok/s':>10}"
        f"{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'ITL p50':>9}{'p99':>8}"
    )


def table_row(r: ServeReport) -> str:
    return (
        f"{r.arm:<24}{r.completed:>6}{r.failed:>5}{r.request_throughput:>8.2f}{r.input_throughput:>10.0f}"
        f"{r.output_throughput:>10.0f}{r.ttft_ms['p50']:>10.1f}{r.ttft_ms['p99']:>8.1f}"
        f"{r.tpot_ms['p50']:>10.2f}{r.itl_ms['p50']:>9.2f}{r.itl_ms['p99']:>8.2f}"
    )
