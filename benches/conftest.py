"""Fixtures for the hand-off benchmarks (helpers live in tokencache_bench.benchkit)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_INTEGRATIONS = Path(__file__).resolve().parents[1] / "integrations"
if str(_INTEGRATIONS) not in sys.path:
    # Lets the benches run from a checkout without `pip install -e integrations`.
    sys.path.insert(0, str(_INTEGRATIONS))


@pytest.fixture(scope="session")
def tokencache_mod() -> Any:
    return pytest.importorskip("tokencache")


@pytest.fixture(scope="session")
def sglang_radix() -> Iterator[Any]:
    """SGLang 0.5.23's Python radix_cache module, imported once (behind the torchvision stub)."""
    pytest.importorskip("sglang")
    from tokencache_sglang.sglang_import import import_sglang

    yield import_sglang()
