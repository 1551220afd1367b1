"""The Triton paged decode kernel, run by Triton's CPU interpreter, against the torch path.

TRITON_INTERPRET must be set before triton is imported, hence a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import torch
from tokencache_models.attention import TorchPagedAttention
from tokencache_models.batch import ForwardBatch
from tokencache_models.triton_decode import paged_decode

torch.manual_seed(0)
for heads, kv_heads, head_dim in [(8, 2, 32), (6, 3, 24)]:
    slots_total = 700
    kc = torch.randn(slots_total, kv_heads, head_dim)
    vc = torch.randn(slots_total, kv_heads, head_dim)
    lens = [1, 7, 64, 65, 300]
    perm = torch.randperm(slots_total)
    pre, new, o = [], [], 0
    for n in lens:
        s = perm[o : o + n]
        o += n
        pre.append(s[:-1])
        new.append(s[-1:])
    batch = ForwardBatch.from_requests([[0]] * len(lens), pre, new)
    q = torch.randn(len(lens), heads, head_dim)
    backend = TorchPagedAttention()
    meta = backend.prepare(batch, torch.device("cpu"))
    ref = backend.forward(q, kc, vc, meta, head_dim**-0.5)
    for block_n in (16, 64):
        out = paged_decode(
            q, kc, vc, batch.kv_slots, batch.kv_offsets.to(torch.int32), head_dim**-0.5,
            max(lens), block_n=block_n,
        )
        err = (out - ref).abs().max().item()
        assert err < 1e-4, (heads, kv_heads, head_dim, block_n, err)
print("OK")
"""


def test_triton_decode_kernel_in_interpreter() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root / "integrations")}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
