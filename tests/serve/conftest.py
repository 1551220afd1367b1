"""Tiny random small/large pair and a word-level tokenizer built in-process (no download)."""

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
sys.path.insert(0, str(HERE))  # serve_helpers


@pytest.fixture(scope="session")
def tiny() -> Iterator[tuple[Any, Any, Any]]:
    """(small, large, tokenizer)."""
    from tokencache_serve.tiny import tiny_pair, tiny_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add overhead
    small, large = tiny_pair(max_position=2048)
    yield small, large, tiny_tokenizer()
    torch.set_num_threads(threads)
