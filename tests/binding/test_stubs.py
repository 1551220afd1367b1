"""The hand-written stubs match the compiled module (mypy.stubtest)."""

from __future__ import annotations

import subprocess
import sys


def test_stubtest_agrees_with_native_module() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "tokencache._native", "--ignore-missing-stub"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
