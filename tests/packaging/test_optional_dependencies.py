"""The integrations' commands without their optional packages: --help works without torch, and a
missing package stops a command with one line naming the extra that installs it.

Each command runs in a subprocess whose ``sys.modules`` maps the blocked packages to None, so
``import torch`` (etc.) raises ImportError there exactly as it does where torch is not
installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokencache_extras import MissingExtra, require, require_or_exit

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "gguf", "safetensors", "accelerate", "sglang", "tqdm")
# (module run as __main__ and its command, what its --help must mention)
COMMANDS = [
    (("tokencache_bench",), "--quick"),
    (("tokencache_routing", "demo"), "--threshold"),
    (("tokencache_routing", "labels"), "--max-new"),
    (("tokencache_routing", "train-router"), "--features"),
    (("tokencache_routing", "quality"), "--engine-check"),
    (("tokencache_routing", "bench"), "python -m tokencache_routing bench [--quick]"),
    (("tokencache_routing", "clock-check"), "--break-even"),
    (("tokencache_routing",), "train-router"),
    (("tokencache_serve",), "serve"),
]


def run_without(
    blocked: tuple[str, ...], module: str, *args: str, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    code = (
        "import runpy, sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None  # import raises ImportError, as if not installed\n"
        f"sys.argv = [{module!r}, *{list(args)!r}]\n"
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "integrations"), *sys.path])}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


@pytest.mark.parametrize(("command", "mentions"), COMMANDS, ids=[" ".join(c) for c, _ in COMMANDS])
def test_help_works_without_torch(command: tuple[str, ...], mentions: str) -> None:
    p = run_without((*HEAVY, "matplotlib"), *command, "--help")
    assert p.returncode == 0, p.stderr
    assert "usage" in p.stdout and mentions in p.stdout


def test_demo_without_torch_says_which_extra_in_one_line() -> None:
    p = run_without(HEAVY, "tokencache_routing", "demo", "--max-new", "1")
    assert p.returncode == 1
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "torch" in lines[0] and 'pip install "./integrations[routing]"' in lines[0]


def test_train_router_without_torch_says_which_extra() -> None:
    p = run_without(HEAVY, "tokencache_routing", "train-router", "--features", "x", "--out", "y")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "[routing]" in p.stderr.strip()


def test_bench_without_matplotlib_or_tqdm_writes_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    p = run_without(
        ("matplotlib", "tqdm"),
        "tokencache_bench",
        "--quick",
        "--only",
        "cursors",
        "--out",
        str(out),
    )
    assert p.returncode == 0, p.stderr
    assert (out / "report.md").read_text().startswith("# tokencache-bench")
    assert "per_L" in json.loads((out / "results.json").read_text())
    assert not (out / "handoff_vs_L.png").exists()
    assert "plot skipped" in p.stderr and "[bench]" in p.stderr
    assert "no progress bar" in p.stderr


def test_require_names_the_extra() -> None:
    with pytest.raises(MissingExtra, match=r"\[models\]") as info:
        require("tokencache_no_such_module", extra="models")
    assert isinstance(info.value, ImportError)
    assert info.value.name == "tokencache_no_such_module"
    assert require("json", extra="models") is json


def test_require_rejects_an_unknown_extra() -> None:
    with pytest.raises(ValueError, match="unknown extra"):
        require("json", extra="everything")


def test_require_or_exit_is_one_line() -> None:
    with pytest.raises(SystemExit) as info:
        require_or_exit("json", "tokencache_no_such_module", extra="bench", prog="prog")
    msg = str(info.value.code)
    assert msg.startswith("prog: tokencache_no_such_module is needed") and "\n" not in msg
