"""The routing README's Python blocks run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "integrations" / "tokencache_routing" / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples() -> None:
    assert BLOCKS


@pytest.mark.parametrize("block", range(len(BLOCKS)))
def test_readme_block_runs(block: int) -> None:
    exec(compile(BLOCKS[block], f"{README.name}[{block}]", "exec"), {})
