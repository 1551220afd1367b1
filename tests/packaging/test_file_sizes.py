"""No source file of the project grows past 700 lines (tests and benches aside): a file that
long holds more than one idea, and is split by responsibility before it lands."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 700
SOURCES = ("integrations", "python", "rust")


def tracked_sources() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--", *SOURCES], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    paths = [ROOT / line for line in out.splitlines() if line.endswith((".py", ".rs"))]
    # a Rust crate's tests/ folder is tests
    return [p for p in paths if "tests" not in p.relative_to(ROOT).parts and p.exists()]


def test_no_source_file_is_over_the_limit() -> None:
    files = tracked_sources()
    assert len(files) > 50  # the listing found the sources
    long = {
        str(p.relative_to(ROOT)): n
        for p in files
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > LIMIT
    }
    assert not long, f"over {LIMIT} lines: {long}"
