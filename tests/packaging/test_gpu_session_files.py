"""The files a GPU session depends on and cannot debug on the device (15 minutes, no network):
the carried wheel list pins one version of each package (two stop pip's whole --no-deps
install there), and the shell scripts parse."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[2] / "benches" / "gpu"


def test_carry_list_pins_each_package_once() -> None:
    names: list[str] = []
    for raw in (GPU / "carry.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+-]*)", line)
        assert m, f"carry.txt: {raw!r} is not name==version"
        names.append(re.sub(r"[-_.]+", "-", m.group(1)).lower())  # PEP 503 normalisation
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert "sglang" in names and "tokencache" not in names  # tokencache's wheel is built here


@pytest.mark.parametrize("script", ["run_all.sh", "device.sh", "prepare_carry.sh"])
def test_gpu_scripts_parse(script: str) -> None:
    res = subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
