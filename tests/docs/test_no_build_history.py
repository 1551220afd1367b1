"""The project's files speak of the project: what it is, does and measures. How it was built
(work-tracker numbers, ordinal work sessions, who edited what) is git's to keep, and a user
can act on none of it; this test keeps it out of every tracked text file."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT = (".py", ".pyi", ".md", ".sh", ".rs", ".toml", ".txt", ".cfg", ".yml", ".yaml")
ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
)
HISTORY = re.compile(
    r"\bissues? ?#?\d+"  # a tracker's numbers: "issue 20", "issues 19"
    rf"|\b({ORDINALS}|\d+(st|nd|rd|th)) session\b"  # "the ninth session"
    r"|\bhelper[- ]\d+"  # a helper's name
    r"|\banother engineer|\bowner's (reading|edit|note)",
    re.IGNORECASE,
)


def tracked_text_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [ROOT / f for f in out.splitlines() if f.endswith(TEXT) and (ROOT / f).is_file()]


def test_no_build_history_in_the_project() -> None:
    hits = []
    for path in tracked_text_files():
        if path == Path(__file__).resolve():  # its own examples below
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "build history in the project's files:\n" + "\n".join(hits)


def test_the_pattern_catches_history_and_spares_the_project() -> None:
    for line in ("as in issue 20's fix", "the ninth session found", "helper-15's case",
                 "(issue #3)", "the 14th session"):  # fmt: skip
        assert HISTORY.search(line), line
    for line in ('@pytest.fixture(scope="session")', "--enable-streaming-session",
                 "the reference owner's slots", "a GPU session's device call"):  # fmt: skip
        assert not HISTORY.search(line), line
