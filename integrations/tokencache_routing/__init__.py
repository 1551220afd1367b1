"""Two-model token-routing decode engine on tokencache cursors (a request never leaves).

The small model decodes; a router escalates hard tokens; the large model catches up over the
tokens written since its own cursor in one batched extend, emits the token, and the request
resumes on the small side. Each model has its own RadixTree over its own KVPool.
"""

from .engine import GenerateResult, RoutedEngine, Stats
from .reference import reference_generate
from .routers import (
    BernoulliRouter,
    EntropyRouter,
    NeuralRouter,
    Router,
    RouterFeatures,
    ScriptedRouter,
    Top1ProbRouter,
)

__all__ = [
    "BernoulliRouter",
    "EntropyRouter",
    "GenerateResult",
    "NeuralRouter",
    "RoutedEngine",
    "Router",
    "RouterFeatures",
    "ScriptedRouter",
    "Stats",
    "Top1ProbRouter",
    "reference_generate",
]
