"""Tiny random small/large model pair (same vocabulary) for exactness tests on CPU."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing in these tests may download
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "integrations"))  # run from a checkout, not installed
sys.path.insert(0, str(HERE))  # routing_helpers


@pytest.fixture(autouse=True)
def checked_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every event loop a test builds records its forwards' times and checks the clock's rules
    on them whenever none is in flight (drivers/forward_trace.py); an engine built in a
    subprocess inherits it."""
    from tokencache_routing.drivers.forward_trace import TRACE_ENV

    monkeypatch.setenv(TRACE_ENV, "1")


@pytest.fixture(scope="session")
def pair() -> Iterator[tuple[Any, Any]]:
    from routing_helpers import tiny_config

    from tokencache_models import random_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add overhead
    small = random_model(tiny_config(1), seed=1, std=0.3, attention_backend="torch").eval()
    large = random_model(tiny_config(2), seed=2, std=0.3, attention_backend="torch").eval()
    yield small, large
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def graphed_pair() -> Iterator[tuple[Any, Any]]:
    """The same pair (same weights) whose forwards all take the graph runners' static paths,
    what CUDA graphs replay, decode padded to its buckets as on CUDA: the exactness suites run
    on it too."""
    from routing_helpers import tiny_config

    from tokencache_models import random_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    small = random_model(tiny_config(1), seed=1, std=0.3, attention_backend="torch").eval()
    large = random_model(tiny_config(2), seed=2, std=0.3, attention_backend="torch").eval()
    for model in (small, large):
        executor = model.executor
        executor.decode_padding = executor.decode_runner = executor.extend_runner = True
    yield small, large
    torch.set_num_threads(threads)
