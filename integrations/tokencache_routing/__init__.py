"""Two-model token-routing decode engine on tokencache cursors (a request never leaves).

The small model decodes; a router escalates hard tokens; the large model catches up over the
tokens written since its own cursor in one batched extend, emits the token, and the request
resumes on the small side. Each model has its own RadixTree over its own KVPool. Requests are
submitted online (RoutedEngine.submit -> RequestHandle); generate() and stream() build on it.

The names below are imported on first use (PEP 562), so that ``python -m
tokencache_routing demo --help`` and the other commands start without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokencache_extras import lazy_attributes

if TYPE_CHECKING:
    from .baselines.reference import reference_generate
    from .config import EngineConfig
    from .core.routers import (
        BernoulliRouter,
        EntropyRouter,
        NeuralRouter,
        Router,
        RouterFeatures,
        ScriptedRouter,
        Top1ProbRouter,
    )
    from .core.scheduler_config import SchedulerConfig
    from .core.state import GenerateResult, RequestHandle, SamplingParams, Stats
    from .engine import RoutedEngine
    from .sim.clock import GpuClock

_HOMES = {
    "EngineConfig": ".config",
    "GpuClock": ".sim.clock",
    "RoutedEngine": ".engine",
    "reference_generate": ".baselines.reference",
    "BernoulliRouter": ".core.routers",
    "EntropyRouter": ".core.routers",
    "NeuralRouter": ".core.routers",
    "Router": ".core.routers",
    "RouterFeatures": ".core.routers",
    "ScriptedRouter": ".core.routers",
    "Top1ProbRouter": ".core.routers",
    "SchedulerConfig": ".core.scheduler_config",
    "GenerateResult": ".core.state",
    "RequestHandle": ".core.state",
    "SamplingParams": ".core.state",
    "Stats": ".core.state",
}

__all__ = [
    "BernoulliRouter",
    "EngineConfig",
    "EntropyRouter",
    "GenerateResult",
    "GpuClock",
    "NeuralRouter",
    "RequestHandle",
    "RoutedEngine",
    "Router",
    "RouterFeatures",
    "SamplingParams",
    "SchedulerConfig",
    "ScriptedRouter",
    "Stats",
    "Top1ProbRouter",
    "reference_generate",
]


__getattr__ = lazy_attributes(__name__, _HOMES, globals())
