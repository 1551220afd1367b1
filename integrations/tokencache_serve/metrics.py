"""Prometheus metrics: the server's own counters and histograms (labelled by endpoint, from a
bounded set), and the engine's snapshot.

Each app owns a CollectorRegistry (several servers in one process do not collide). The engine's
numbers are read from RoutedEngine.metrics() at scrape time by a custom collector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "tokencache"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Monotonic keys among RoutedEngine.metrics()' (exported as counters); the others are gauges,
# and "<model>_kv_slots_<state>" keys become one labelled gauge.
_ENGINE_COUNTERS = frozenset(
    (
        "requests_submitted",
        "requests_finished",
        "requests_aborted",
        "requests_failed",
        "tokens_generated",
        "tokens_large",
        "escalations",
        "catchups",
        "preemptions",
        "small_steps",
    )
)
_MODELS = ("small", "large")
# The server's routes: the endpoint label's values (with "/v1/models/{id}" and "other").
ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/server_info",
    "/model_info",
    "/v1/loads",
)


def endpoint_label(path: str) -> str:
    """A bounded metrics label: a client's arbitrary path must not create a new time series."""
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return path if path in ENDPOINTS else "other"


class EngineCollector(Collector):
    """Exports RoutedEngine.metrics() at each scrape (every key it has, so new keys appear)."""

    def __init__(self, snapshot: Callable[[], Mapping[str, float]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        m = dict(self._snapshot())
        slots = GaugeMetricFamily(
            f"{PREFIX}_kv_slots",
            "KV pool slots per model and state (used = not free; cached = held by the tree)",
            labels=["model", "state"],
        )
        for key in sorted(m):
            model, _, state = key.partition("_kv_slots_")
            if model in _MODELS and state:
                slots.add_metric([model, state], float(m[key]))
                continue
            name = f"{PREFIX}_engine_{key}"
            doc = f"RoutedEngine.metrics()['{key}']"
            if key in _ENGINE_COUNTERS:
                c = CounterMetricFamily(name, doc)
                c.add_metric([], float(m[key]))
                yield c
            else:
                g = GaugeMetricFamily(name, doc)
                g.add_metric([], float(m[key]))
                yield g
        yield slots
        # Each escalation has the large model write one token (unless aborted meanwhile).
        tokens = float(m.get("tokens_generated", 0))
        large = float(m.get("tokens_large", m.get("escalations", 0)))
        share = GaugeMetricFamily(
            f"{PREFIX}_escalation_share", "share of generated tokens written by the large model"
        )
        share.add_metric([], large / tokens if tokens else 0.0)
        yield share


class ServerMetrics:
    def __init__(self, engine_snapshot: Callable[[], Mapping[str, float]] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            f"{PREFIX}_http_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.requests = Counter(
            f"{PREFIX}_requests",
            "generation requests finished, by endpoint and finish reason",
            ["endpoint", "finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "prompt tokens of finished requests", registry=r
        )
        self.completion_tokens = Counter(
            f"{PREFIX}_completion_tokens", "tokens returned to clients", registry=r
        )
        self.completion_tokens_large = Counter(
            f"{PREFIX}_completion_tokens_large",
            "tokens returned to clients that the large model wrote",
            registry=r,
        )
        self.disconnects = Counter(
            f"{PREFIX}_client_disconnects", "requests aborted because the client left", registry=r
        )
        self.prompt_tokens_looked_up = Counter(
            f"{PREFIX}_prompt_tokens_looked_up",
            "prompt tokens matched against the prefix caches at arrival (all but the last)",
            registry=r,
        )
        self.prompt_tokens_cached = Counter(
            f"{PREFIX}_prompt_tokens_cached",
            "prompt tokens a model's prefix cache held at arrival (prefix hits)",
            ["model"],
            registry=r,
        )
        for model in _MODELS:  # both series exist from the start (0 before any hit)
            self.prompt_tokens_cached.labels(model)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "request arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.per_token = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "mean time between output tokens after the first, per request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "request arrival to its last byte",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        if engine_snapshot is not None:
            r.register(EngineCollector(engine_snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)
