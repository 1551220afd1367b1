"""Every ```python block of the READMEs runs as written (each in a fresh namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The READMEs whose snippets must run here: the top-level one and the integrations' that need
# nothing beyond the test environment (the SGLang backend's README has shell blocks only).
READMES = [ROOT / "README.md", ROOT / "integrations" / "tokencache_sglang" / "README.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def snippets() -> list[tuple[str, str]]:
    out = []
    for path in READMES:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{path.relative_to(ROOT)}:{line}", m.group(1)))
    return out


def test_the_readme_has_snippets() -> None:
    assert any(where.startswith("README.md") for where, _ in snippets())


@pytest.mark.parametrize(("where", "code"), snippets(), ids=[w for w, _ in snippets()])
def test_snippet_runs(where: str, code: str) -> None:
    exec(compile(code, where, "exec"), {"__name__": f"readme_{abs(hash(where))}"})


def test_no_links_leave_the_repository() -> None:
    """Relative links and paths in the READMEs point inside the checkout."""
    for path in READMES:
        for target in re.findall(r"\]\(([^)#]+)\)", path.read_text()):
            if "://" in target:
                continue
            assert (path.parent / target).resolve().is_relative_to(ROOT), (path, target)
            assert (path.parent / target).exists(), (path, target)
        assert "../shared" not in path.read_text(), path
