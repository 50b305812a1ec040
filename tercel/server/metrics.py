"""Prometheus metrics for the server, on a private registry (several apps can live in one process).

Each metric is one line below; adding one is one line too. The speculative-decoding metrics are
labelled by algorithm; they stay empty while speculative decoding is off (the engine loop feeds them
from LLMEngine.spec_stats() after each step).
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "tercel_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0)
ACCEPT_LENGTH_BUCKETS = tuple(float(i) for i in range(1, 17))


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        c, g, h = self._counter, self._gauge, self._histogram
        self.requests = c("requests", "HTTP requests by endpoint and status code.", ["endpoint", "status"])
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens of requests added to the engine.")
        self.generation_tokens = c("generation_tokens", "Tokens generated.")
        self.running = g("num_requests_running", "Engine requests running (in the batch).")
        self.waiting = g("num_requests_waiting", "Engine requests waiting to be scheduled.")
        self.kv_blocks_used = g("kv_blocks_used", "KV-cache blocks in use.")
        self.kv_blocks_total = g("kv_blocks_total", "KV-cache blocks usable by requests.")
        self.kv_blocks_cached = g("kv_blocks_cached", "KV-cache blocks no request holds that keep a cached prefix "
                                  "(reused by a prefix hit, evicted when the pool needs room).")
        self.prefix_cache_queries = g("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = g("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.")
        self.prefix_cache_hit_rate = g("prefix_cache_hit_rate", "Prefix-cache hit tokens / queried tokens "
                                       "(0 before any query).")
        self.ttft = h("time_to_first_token_seconds", "From request arrival to its first token.", TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Time between successive tokens of a request.", LATENCY_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "From request arrival to its last token.", TTFT_BUCKETS)
        self.spec_accept_length = h("spec_decode_accept_length", "Tokens accepted per speculative verify step "
                                    "(including the bonus token).", ACCEPT_LENGTH_BUCKETS, ["algorithm"])
        self.connections_open = g("connections_open", "Open client connections (refused ones not counted).")
        self.connections_closed = c("connections_closed", "Connections the server closed on a client: "
                                    "header_timeout, body_timeout, over_limit (--max-connections).", ["reason"])
        self.spec_accept_rate = g("spec_decode_accept_rate", "Fraction of drafted tokens accepted.", ["algorithm"])

    # ---- one-line constructors ---------------------------------------------------------------
    def _counter(self, name: str, doc: str, labels: list[str] | None = None) -> Counter:
        return Counter(PREFIX + name, doc, labels or [], registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: list[str] | None = None) -> Gauge:
        return Gauge(PREFIX + name, doc, labels or [], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...],
                   labels: list[str] | None = None) -> Histogram:
        return Histogram(PREFIX + name, doc, labels or [], buckets=buckets, registry=self.registry)

    # ---- wiring --------------------------------------------------------------------------------
    def bind_engine_stats(self, stats: Callable[[], object], pending: Callable[[], int]) -> None:
        """Gauges read live at scrape time. stats() returns tercel.engine.EngineStats; pending() counts
        requests accepted by the server but not yet handed to the engine (they wait too)."""
        self.running.set_function(lambda: stats().num_running)
        self.waiting.set_function(lambda: stats().num_waiting + pending())
        self.kv_blocks_used.set_function(lambda: stats().kv_blocks_used)
        self.kv_blocks_total.set_function(lambda: stats().kv_blocks_total)
        self.kv_blocks_cached.set_function(lambda: stats().kv_blocks_cached)
        self.prefix_cache_queries.set_function(lambda: stats().prefix_cache_queried_tokens)
        self.prefix_cache_hits.set_function(lambda: stats().prefix_cache_hit_tokens)
        self.prefix_cache_hit_rate.set_function(lambda: stats().prefix_cache_hit_rate or 0.0)

    def observe_spec_accept(self, algorithm: str, accept_length: int, count: int = 1) -> None:
        """count verify steps that each emitted accept_length tokens (accepted drafts + the bonus token)."""
        h = self.spec_accept_length.labels(algorithm)
        for _ in range(count):
            h.observe(accept_length)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
