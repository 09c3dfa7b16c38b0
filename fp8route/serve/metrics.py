"""/metrics in Prometheus' text format, under vLLM's metric names with an fp8route: prefix.

The engine's state and counters come from one snapshot() of the engine per scrape, so they agree with
each other. TTFT and end-to-end latency are the engine's own clock (arrival to first token, to the
last), observed as each request finishes; inter-token latency is observed where the server hands a
step's tokens on. What happened to each request the server took (finished, client gone, failed) and
to each it refused is counted here too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from fp8route.engine.async_llm import EngineClient
from fp8route.engine.request import RequestMetrics

PREFIX = "fp8route:"
# vLLM's buckets, so dashboards built for it read ours the same way (ITL's with finer ones below 10 ms).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class _EngineCollector:
    def __init__(self, engine: EngineClient, in_flight: Callable[[], int]) -> None:
        self.engine, self.in_flight = engine, in_flight

    def collect(self) -> Iterator[Metric]:
        s = self.engine.snapshot()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(PREFIX + name, doc, value=value)

        yield gauge("num_requests_running", "Requests in the engine's running batch.", s.running)
        yield gauge("num_requests_waiting", "Requests queued in the engine, not yet running.", s.waiting)
        yield gauge(
            "num_requests_in_flight",
            "HTTP generation requests the server has taken and not answered.",
            self.in_flight(),
        )
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of the KV pool's blocks in use (0 to 1).",
            s.kv_used_blocks / max(1, s.kv_total_blocks),
        )
        yield gauge("kv_cache_used_blocks", "KV pool blocks held by requests.", s.kv_used_blocks)
        yield gauge("kv_cache_total_blocks", "KV pool blocks in all.", s.kv_total_blocks)
        hit_rate = s.prefix_hit_tokens / s.prefix_queried_tokens if s.prefix_queried_tokens else 0.0
        yield gauge("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache, of those looked up.", hit_rate)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queried_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hit_tokens)
        yield counter("prompt_tokens", "Prompt tokens of the requests the engine finished.", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("num_preemptions", "Requests preempted to free KV blocks.", s.preemptions)
        yield counter(
            "steps_launched_ahead", "Decode steps launched before the step before them was read back.",
            s.steps_launched_ahead,
        )  # fmt: skip
        rss = _resident_bytes(getattr(self.engine, "pid", None))
        if rss is not None:  # the engine's own process (process_resident_memory_bytes is the server's)
            yield gauge("engine_resident_memory_bytes", "Resident memory of the engine's process.", rss)


def _resident_bytes(pid: int | None) -> int | None:
    """A process's resident memory from /proc (Linux); None elsewhere or when it is gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class Metrics:
    def __init__(self, engine: EngineClient, in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, in_flight))  # type: ignore[arg-type]
        ProcessCollector(registry=self.registry)  # resident memory: a long run's leak shows here
        reg = self.registry
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Arrival to first token.", buckets=TTFT_BUCKETS, registry=reg
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Between a request's consecutive steps' tokens.",
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to last token.", buckets=E2E_BUCKETS, registry=reg
        )
        self.success = Counter(
            PREFIX + "request_success",
            "Requests answered in full, by finish reason.",
            ["finished_reason"],
            registry=reg,
        )
        self.aborted = Counter(
            PREFIX + "request_aborted",
            "Requests whose client left before the end (aborted, blocks freed).",
            registry=reg,
        )
        self.failed = Counter(PREFIX + "request_failed", "Requests the engine failed (answered 500).", registry=reg)
        self.rejected = Counter(
            PREFIX + "request_rejected", "Requests refused before any work, by HTTP status.", ["status"], registry=reg
        )
        engine.on_finished.append(self.observe_finished)

    def observe_finished(self, m: RequestMetrics) -> None:
        """On the engine's thread, as the engine finishes a request (prometheus_client is thread-safe)."""
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
