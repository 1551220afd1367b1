"""Every Triton kernel the runner launches compiles for the H200 (sm_90), on this CPU.

benches/gpu/compile_check.py runs the runner's forwards at Qwen3-0.6B and Qwen3-8B shapes with
each launch turned into a compile for sm_90 (Triton and its ptxas need no GPU). The interpreter
tests prove the kernels right; this proves a GPU session will not lose its minutes to a kernel
that does not build, or that asks for more shared memory or registers than a block gets.
A subprocess: the script swaps Triton's active driver, which must not leak into other tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benches" / "gpu" / "compile_check.py"


def _toolchain_missing() -> str | None:
    try:
        import triton.backends.nvidia as nvidia
    except ImportError as e:  # a CPU-only torch build comes without triton
        return f"triton's CUDA backend is not importable ({e})"
    for tool in ("ptxas", "cuobjdump"):
        if not (Path(nvidia.__file__).parent / "bin" / tool).exists():
            return f"triton's CUDA backend ships no {tool}"
    return None


def _expected_kernels() -> tuple[str, ...]:
    """The script's own list of every kernel the runner can launch (imported, not copied)."""
    spec = importlib.util.spec_from_file_location("compile_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)  # imports only; patches nothing until its context manager
    return tuple(module.EXPECTED_KERNELS)


@pytest.mark.skipif(_toolchain_missing() is not None, reason=str(_toolchain_missing()))
def test_every_runner_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = tmp_path / "compiled.json"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", "90", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows: list[dict[str, Any]] = json.loads(out.read_text())["rows"]
    by_kernel: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_kernel.setdefault(r["kernel"], []).append(r)
    assert set(by_kernel) >= set(_expected_kernels())
    # Both GQA groups (0.6B: 2, 8B: 4), both attention precisions, split and unsplit catch-ups,
    # and every merge width a decode batch of 1..64 asks for.
    varlen = {
        (c["GROUP"], c["IEEE"], c["PARTIAL"])
        for c in (r["constexprs"] for r in by_kernel["_paged_varlen_kernel"])
    }
    assert varlen == {(g, i, p) for g in (2, 4) for i in (False, True) for p in (False, True)}
    # The shared-prefix path: the kernel at both GQA groups and precisions, and the decode and
    # varlen kernels in their prefix-skipping variants.
    prefix = {(c["GROUP"], c["IEEE"]) for c in (r["constexprs"] for r in by_kernel[
        "_shared_prefix_kernel"])}  # fmt: skip
    assert prefix == {(g, i) for g in (2, 4) for i in (False, True)}
    for kernel in ("_paged_decode_kernel", "_paged_varlen_kernel"):
        assert any(r["constexprs"]["SKIP"] for r in by_kernel[kernel]), kernel
    merge_widths = {r["constexprs"]["SPLITS_PAD"] for r in by_kernel["_merge_splits_kernel"]}
    assert merge_widths >= {1, 2, 4, 8, 16, 32}
    for r in rows:
        assert 0 < r["registers"] <= 255, r
        assert r["shared"] <= 232_448, r
    # The benchmarks' paths: bf16 attention kernels keep everything in registers (no local
    # memory) with the pinned triton.
    attention = ("_paged_decode_kernel", "_paged_varlen_kernel", "_shared_prefix_kernel")
    bf16 = [r for r in rows if r["kernel"] in attention and r["signature"]["K"] == "*bf16"]
    assert len(bf16) >= 8 and all(r["local_bytes"] == 0 for r in bf16), bf16
