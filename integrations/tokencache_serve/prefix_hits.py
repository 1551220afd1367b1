"""Prompt tokens each model's prefix cache already holds when a request arrives (what a
prefix-aware gateway wins): Prometheus counters per model, and the small model's hit rate,
which /v1/loads reports to the gateway."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokencache_routing import RoutedEngine

    from .metrics import ServerMetrics


class PrefixHits:
    def __init__(self, engine: RoutedEngine, metrics: ServerMetrics) -> None:
        self._engine = engine
        self._metrics = metrics
        self._lock = threading.Lock()
        self._looked_up = 0  # prompt tokens matched against the caches
        self._small_hits = 0  # of them, held by the small model's, which prefills every prompt

    def count(self, ids: list[int]) -> None:
        """The longest match of all but the last token, as the engine admits. Runs in a
        worker thread; the tree is thread-safe (a split keeps every handle valid)."""
        if len(ids) < 2:
            return
        head = ids[:-1]
        self._metrics.prompt_tokens_looked_up.inc(len(head))
        hits = {}
        for side in self._engine.sides:
            hits[side.name] = int(side.tree.match_prefix(head).length)
            self._metrics.prompt_tokens_cached.labels(side.name).inc(hits[side.name])
        with self._lock:
            self._looked_up += len(head)
            self._small_hits += hits.get("small", 0)

    def small_hit_rate(self) -> float:
        with self._lock:
            return self._small_hits / self._looked_up if self._looked_up else 0.0
