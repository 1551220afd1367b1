"""import_sglang where torch sees a GPU but sglang's CUDA kernels (sgl_kernel) are not installed,
as on the device machine, which carries sglang installed with --no-deps.

A subprocess fakes the GPU (torch.cuda.is_available -> True, a device name and properties):
sglang 0.5.23 then imports sgl_kernel at module level and fails, unless the import runs with
CUDA hidden. Afterwards torch must see its GPU again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib.util
import torch

assert importlib.util.find_spec("sgl_kernel") is None, "this test needs sgl_kernel absent"
torch.cuda.is_available = lambda: True
torch.version.cuda = "13.0"
torch.cuda.device_count = lambda: 1
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)


class Props:
    name, major, minor, total_memory, multi_processor_count = "NVIDIA H200", 9, 0, 1 << 37, 132


torch.cuda.get_device_properties = lambda *a, **k: Props()

from tokencache_sglang.sglang_import import import_sglang

radix_cache = import_sglang()
assert radix_cache.RadixCache.__name__ == "RadixCache"
assert torch.cuda.is_available()  # restored after the import
print("OK")
"""


def test_radix_cache_imports_where_torch_sees_a_gpu_without_sgl_kernel() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "integrations"), env.get("PYTHONPATH", "")) if p
    )
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stderr[-3000:]
