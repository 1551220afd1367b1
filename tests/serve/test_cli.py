"""The command line: `python -m tokencache_serve` and the `tokencache` console script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokencache_serve.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "integrations"), "HF_HUB_OFFLINE": "1"}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env=ENV)


def test_python_m_help() -> None:
    r = run(sys.executable, "-m", "tokencache_serve", "--help")
    assert r.returncode == 0 and "serve" in r.stdout
    r = run(sys.executable, "-m", "tokencache_serve", "serve", "--help")
    assert r.returncode == 0
    for flag in ("--small", "--large", "--small-layers", "--router", "--host", "--port"):
        assert flag in r.stdout
    assert "--max-running" in r.stdout and "--num-slots" in r.stdout


def test_console_script_help() -> None:
    exe = shutil.which("tokencache", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the tokencache console script is not installed (pip install -e integrations)")
    r = run(exe, "serve", "--help")
    assert r.returncode == 0 and "--router" in r.stdout


def test_defaults() -> None:
    a = build_parser().parse_args(["serve"])
    assert (a.large, a.small, a.small_layers) == ("smollm2", None, 24)
    assert (a.host, a.port, a.router) == ("127.0.0.1", 8000, "entropy:0.5")


def test_bad_arguments_fail_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2  # no command: help
    assert main(["serve", "--large", "/no/such/model"]) == 2
    assert "no/such/model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--mode", "warp"])
    assert main(["serve", "--min-occupancy", "1.5"]) == 2  # refused before any model loads
    assert "min_occupancy must be in [0, 1]" in capsys.readouterr().err
