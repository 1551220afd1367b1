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


def test_chunked_prefill_flags() -> None:
    a = build_parser().parse_args(["serve"])
    assert (a.chunked_prefill_size, a.large_chunked_prefill_size) == (None, None)  # the engine's
    a = build_parser().parse_args(
        ["serve", "--chunked-prefill-size", "16", "--large-chunked-prefill-size=0"]
    )
    assert (a.chunked_prefill_size, a.large_chunked_prefill_size) == (16, 0)
    r = run(sys.executable, "-m", "tokencache_serve", "serve", "--help")
    assert "--chunked-prefill-size N" in r.stdout and "--large-chunked-prefill-size N" in r.stdout


@pytest.mark.parametrize("flag", ["--chunked-prefill-size", "--large-chunked-prefill-size"])
@pytest.mark.parametrize("value", ["-1", "-2048", "2.5", "1e3", "many", ""])
def test_bad_chunked_prefill_sizes_are_refused(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused by the parser, before any model loads (and before --replicas starts any)."""
    with pytest.raises(SystemExit) as e:
        main(["serve", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be an integer >= 0 (0: off), got {value!r}" in err


def test_bad_chunked_prefill_size_from_the_command_line() -> None:
    r = run(sys.executable, "-m", "tokencache_serve", "serve", "--chunked-prefill-size", "-16")
    assert r.returncode == 2
    assert "argument --chunked-prefill-size: must be an integer >= 0 (0: off), got '-16'" in (
        r.stderr
    )


def test_replicas_get_the_chunked_prefill_flags() -> None:
    from tokencache_serve.replicas import replica_command, strip_fleet_options

    argv = ["serve", "--replicas", "2", "--chunked-prefill-size", "16", "--port", "9000",
            "--large-chunked-prefill-size=256"]  # fmt: skip
    cmd = replica_command(strip_fleet_options(argv), 9001)
    assert cmd[cmd.index("--chunked-prefill-size") + 1] == "16"
    assert "--large-chunked-prefill-size=256" in cmd
    a = build_parser().parse_args(cmd[3:])  # what replica k parses
    assert (a.chunked_prefill_size, a.large_chunked_prefill_size) == (16, 256)
