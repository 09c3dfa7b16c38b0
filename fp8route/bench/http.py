"""`fp8route bench serve --url`: the offline benchmark's load sent to any OpenAI-compatible server.

Each request is one streamed /v1/completions call (token ids as the prompt, or their text) asking
for exactly the load's output length (ignore_eos, temperature 0). TTFT and inter-token latencies
come from the arrival of SSE chunks that carry a choice, token counts from the usage the server
reports at the end (stream_options.include_usage). Every request ends in exactly one outcome:
completed, failed with an HTTP status (503s counted apart: a full queue's answer), failed without
one (connection, timeout), cut short without an error, or closed on purpose (--disconnect-fraction)
after a random number of chunks. Only aiohttp is needed, so it runs where the server extra is not.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from fp8route.bench.workload import LoadRequest, RequestResult
from fp8route.errors import Fp8InputError

COMPLETED, DISCONNECTED, INCOMPLETE, ERROR = "completed", "disconnected", "incomplete", "error"


@dataclass
class HttpRun:
    results: list[RequestResult]  # the requests that were not closed on purpose, in load order
    duration_s: float
    outcomes: Counter[str] = field(default_factory=Counter)  # completed, disconnected, incomplete, error, http_503, ...
    errors: list[str] = field(default_factory=list)  # the first few, for the report

    @property
    def lost(self) -> int:
        """Requests that ended in anything but a full answer, a 503 or a planned disconnect."""
        return sum(n for kind, n in self.outcomes.items() if kind not in (COMPLETED, DISCONNECTED, "http_503"))


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def served_model(session: aiohttp.ClientSession, url: str, api_key: str | None) -> str:
    """The first model GET /v1/models lists: what to ask for when --model is not given."""
    async with session.get(f"{url}/v1/models", headers=_headers(api_key)) as response:
        body = await response.text()
        if response.status != 200:
            raise Fp8InputError(f"{url}/v1/models answered {response.status}: {body[:200]}; check --url and --api-key")
        models = json.loads(body).get("data") or []
    if not models:
        raise Fp8InputError(f"{url}/v1/models lists no model; give --model")
    return str(models[0]["id"])


async def check_reachable(session: aiohttp.ClientSession, url: str) -> None:
    """One GET before the load, whatever it answers: nobody listening at --url is one line, not a
    warm-up of failed requests."""
    try:
        async with session.get(f"{url}/v1/models"):
            pass
    except aiohttp.ClientConnectorError as exc:
        raise Fp8InputError(f"--url {url}: {exc}; is the server running there?") from None


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The server's /metrics as {'name{labels}': value}; empty if it has none (not every server does)."""
    try:
        async with session.get(f"{url}/metrics") as response:
            if response.status != 200:
                return {}
            text = await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                values[name] = float(value)
            except ValueError:
                continue
    return values


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, object],
    item: LoadRequest,
    leave_after: int | None,
    api_key: str | None,
) -> tuple[str, RequestResult]:
    sent = time.monotonic()
    stamps: list[float] = []
    usage: dict[str, object] = {}

    def result(error: str = "") -> RequestResult:
        tokens = int(usage.get("completion_tokens", len(stamps)))  # type: ignore[call-overload]
        details = usage.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
        ttft = stamps[0] - sent if stamps else 0.0
        e2e = (stamps[-1] if stamps else time.monotonic()) - sent
        itl = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        prompt = int(usage.get("prompt_tokens", len(item.prompt_ids)))  # type: ignore[call-overload]
        return RequestResult(prompt, tokens, item.output_len, ttft, e2e, itl, error=error, cached_tokens=cached)

    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=_headers(api_key)) as response:
            if response.status != 200:
                text = await response.text()
                try:
                    message = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = text[:200]
                return f"http_{response.status}", result(f"HTTP {response.status}: {message}")
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return ERROR, result(f"error in the stream: {chunk['error'].get('message')}")
                if chunk.get("choices"):
                    stamps.append(time.monotonic())
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if leave_after is not None and len(stamps) >= leave_after:
                    response.close()  # drops the connection mid-stream, as a client that gives up does
                    return DISCONNECTED, result("disconnected on purpose")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return ERROR, result(f"{type(exc).__name__}: {exc}")
    out = result()
    if out.output_tokens != item.output_len:
        out.error = f"{out.output_tokens} of {item.output_len} tokens"
        return INCOMPLETE, out
    return COMPLETED, out


async def run_http_load(
    url: str,
    load: Sequence[LoadRequest],
    *,
    model: str | None = None,
    api_key: str | None = None,
    prompts: Sequence[str] | None = None,
    disconnect_fraction: float = 0.0,
    seed: int = 0,
    timeout_s: float = 600.0,
) -> tuple[HttpRun, dict[str, float], dict[str, float], str]:
    """Send the load, each request at its arrival time; (the run, /metrics before, after, the model)."""
    if not 0 <= disconnect_fraction <= 1:
        raise Fp8InputError(f"--disconnect-fraction must be in [0, 1], got {disconnect_fraction}")
    url = url.rstrip("/")
    rng = random.Random(seed)
    leave = [rng.randint(1, max(1, r.output_len - 1)) if rng.random() < disconnect_fraction else None for r in load]
    # No connection limit: a load that arrives at once must reach the server at once, not queue in the client.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await check_reachable(session, url)
        model = model or await served_model(session, url, api_key)
        before = await scrape(session, url)
        start = time.monotonic()

        async def at_arrival(i: int, item: LoadRequest) -> tuple[str, RequestResult]:
            await asyncio.sleep(max(0.0, start + item.arrival_s - time.monotonic()))
            body: dict[str, object] = {
                "model": model, "prompt": prompts[i] if prompts is not None else item.prompt_ids,
                "max_tokens": item.output_len, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True},
            }  # fmt: skip
            return await _one(session, url, body, item, leave[i], api_key)

        ended = await asyncio.gather(*(at_arrival(i, item) for i, item in enumerate(load)))
        duration = time.monotonic() - start
        after = await _settled(session, url)
    run = HttpRun([r for kind, r in ended if kind != DISCONNECTED], duration, Counter(kind for kind, _ in ended))
    run.errors = [r.error for kind, r in ended if kind not in (COMPLETED, DISCONNECTED)][:5]
    return run, before, after, model


async def _settled(session: aiohttp.ClientSession, url: str, wait_s: float = 10.0) -> dict[str, float]:
    """/metrics once the server says nothing runs (aborts land within a step), or after wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        now = await scrape(session, url)
        busy = now.get("fp8route:num_requests_running", 0) + now.get("fp8route:kv_cache_used_blocks", 0)
        if not busy or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.1)
