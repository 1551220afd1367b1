"""Compiles every Triton kernel the model runner launches for a GPU that is not here.

No GPU needed (a CPU run, in CI too): Triton's compiler and the ptxas it ships run on the CPU.
The runner's forwards run on the CPU with Triton told that the current device is the target
architecture (default sm_90, the H200) and every launch turned into a warm-up: Triton binds and
specialises the real arguments exactly as at a launch, compiles, and launches nothing (kernel
outputs stay uninitialised; only shapes drive the host code). Shapes are the real attention and
hidden shapes of Qwen3-0.6B, Qwen3-8B and Llama 3.2 1B (head_dim 64, no q/k norm; one layer, a
small vocab), in bf16 (the benchmarks) and
fp32 (decode_step.py's exactness check), over decode batches 1..64 (every split-KV merge width),
catch-ups that split and a prefill that does not, so each kernel variant a GPU run meets is
built here first. Each cubin's registers, spills and shared memory are read with cuobjdump.

Exits 1 when a kernel fails to compile, needs more shared memory or registers than the target
gives a block, or when a kernel of the runner was never launched; local memory (spills) is
reported, not failed. Run it in a process of its own (as its test does): Triton keeps the
target a kernel was first bound to, so a kernel launched before in the same process would be
compiled for that device, and one bound here keeps sm_90 afterwards.

    python benches/gpu/compile_check.py [--arch 90] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations"))  # runs from a checkout without installing

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from tokencache_models import PRESETS, CausalLM, ForwardBatch, KVPool, random_model  # noqa: E402

# Shared memory a block may use (opt-in maximum) and registers per SM, by compute capability.
SHARED_LIMIT = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
REGISTERS_PER_SM = 65_536
# Every kernel the runner can launch; one missing from the record means a path went untested.
EXPECTED_KERNELS = (
    "_paged_decode_kernel",
    "_paged_varlen_kernel",
    "_shared_prefix_kernel",
    "_merge_splits_kernel",
    "_add_rmsnorm_kernel",
    "_qkv_norm_rope_store_kernel",
    "_silu_mul_kernel",
)


class _TargetOnlyDriver:
    """Just enough of a Triton driver for JITFunction.run(warmup=True): the target to compile
    for, and a device and stream that nothing will ever launch on."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@dataclasses.dataclass
class Compiled:
    kernel: str
    constexprs: dict[str, Any]
    signature: dict[str, str]
    num_warps: int
    num_stages: int
    shared: int
    registers: int
    local_bytes: int  # spills and stack, per thread
    launches: int = 1


@contextmanager
def compile_instead_of_launch(arch: int, record: dict[str, Compiled]) -> Iterator[None]:
    """Inside: every Triton launch compiles for cuda:`arch` and returns; `record` collects one
    entry per distinct compiled kernel (keyed by its compile hash), counting its launches."""
    original_run = JITFunction.run

    def run(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        key = kernel.hash
        if key in record:
            record[key].launches += 1
        else:
            record[key] = describe(self, kernel)
        return kernel

    # Not driver.active: that creates the default driver, which fails on a machine without one.
    previous = driver._active
    driver.set_active(_TargetOnlyDriver(GPUTarget("cuda", arch, 32)))
    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = original_run
        driver.set_active(previous)


def describe(fn: JITFunction, kernel: Any) -> Compiled:
    src = kernel.src
    names = [p.name for p in fn.params]
    constexprs = {names[path[0]]: _plain(v) for path, v in src.constants.items() if len(path) == 1}
    regs, local = cubin_resources(kernel.asm["cubin"])
    meta = kernel.metadata
    return Compiled(
        kernel=fn.__name__,
        constexprs=constexprs,
        signature={k: v for k, v in src.signature.items() if v != "constexpr"},
        num_warps=meta.num_warps,
        num_stages=meta.num_stages,
        shared=meta.shared,
        registers=regs,
        local_bytes=local,
    )


def _plain(v: Any) -> Any:
    v = getattr(v, "value", v)
    return v if isinstance(v, (bool, int, float, str)) or v is None else repr(v)


def cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, local memory bytes per thread) of a one-kernel cubin."""
    tool = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:\d+\s+LOCAL:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{text}")
    regs, stack, local = (int(g) for g in found.groups())
    return regs, stack + local


def one_layer(name: str, dtype: torch.dtype) -> CausalLM:
    """The preset's attention and hidden shapes, one layer, a small vocab (the lm head is torch)."""
    config = dataclasses.replace(PRESETS[name], num_hidden_layers=1, vocab_size=256)
    model = random_model(config, dtype=dtype, attention_backend="triton")
    model.fused = True
    model.executor.decode_graphs = (
        False  # graph replay launches the same kernels (padded batch buckets)
    )
    return model


def batches(vocab: int) -> Iterator[tuple[str, ForwardBatch]]:
    """Decode at every batch size whose split-KV merge width differs, catch-ups that split (and
    one that is a decode of one token each), a prefill that does not split; then the same
    kinds over a shared 512-slot prefix (the shared-prefix kernel and the skipping variants)."""
    perm = torch.randperm(16 * 1024)
    for bs in (1, 2, 4, 8, 16, 32, 64):
        yield f"decode b={bs}", _requests([[1]] * bs, [4] * bs, perm)
    yield "catch-up 2x10@4096", _requests([[1] * 10] * 2, [4086] * 2, perm)
    yield "catch-up 3x1@600", _requests([[1]] * 2 + [[1] * 3], [600, 600, 598], perm)
    yield "prefill 2x300", _requests([[1] * 300] * 2, [0, 0], perm)
    for bs in (2, 8, 32, 64):
        yield f"shared decode b={bs}", _requests([[1]] * bs, [4] * bs, perm, shared=512)
    yield "shared catch-up 3x10", _requests([[1] * 10] * 3, [40] * 3, perm, shared=512)


def _requests(
    new: list[list[int]], cached: list[int], perm: torch.Tensor, shared: int = 0
) -> ForwardBatch:
    """Request i: `shared` slots common to all, cached[i] own ones, then its new tokens."""
    prefixes, slots, o = [], [], shared
    for toks, n in zip(new, cached, strict=True):
        prefixes.append(torch.cat((perm[:shared], perm[o : o + n])))
        slots.append(perm[o + n : o + n + len(toks)])
        o += n + len(toks)
    return ForwardBatch.from_requests(new, prefixes, slots)


def check(arch: int, models: Sequence[str], dtypes: Sequence[torch.dtype]) -> list[Compiled]:
    record: dict[str, Compiled] = {}
    with compile_instead_of_launch(arch, record):
        for name in models:
            for dtype in dtypes:
                model = one_layer(name, dtype)
                pool = KVPool.for_config(model.config, 16 * 1024, dtype=dtype)
                for label, batch in batches(model.config.vocab_size):
                    t0 = time.monotonic()
                    n = len(record)
                    model.forward(batch, pool)
                    took = time.monotonic() - t0
                    print(f"{name} {dtype} {label}: {len(record) - n} new kernels, {took:.1f} s")
    return list(record.values())


def problems(arch: int, compiled: Sequence[Compiled]) -> list[str]:
    launched = {c.kernel for c in compiled}
    out = [f"{k} was never launched" for k in EXPECTED_KERNELS if k not in launched]
    limit = SHARED_LIMIT.get(arch)
    if limit is None:
        print(f"note: no shared-memory limit known for sm_{arch}; not checked", file=sys.stderr)
    for c in compiled:
        if limit is not None and c.shared > limit:
            out.append(f"{c.kernel} {c.constexprs}: {c.shared} B shared > {limit} B on sm_{arch}")
        if c.registers * 32 * c.num_warps > REGISTERS_PER_SM:
            out.append(f"{c.kernel} {c.constexprs}: {c.registers} registers x {c.num_warps} warps")
    return out


def markdown(compiled: Sequence[Compiled], arch: int) -> str:
    """One line per kernel variant as shown (variants that differ only in argument alignment or
    in the dtype of an argument not shown are counted together)."""
    groups: dict[tuple[Any, ...], list[Compiled]] = {}
    for c in compiled:
        consts = ", ".join(f"{k}={v}" for k, v in c.constexprs.items())
        types = ",".join(sorted({t.lstrip("*") for t in c.signature.values() if t.startswith("*")}))
        shown = (c.kernel, consts, types, c.num_warps, c.num_stages, c.registers)
        groups.setdefault((*shown, c.local_bytes, c.shared), []).append(c)
    lines = [
        f"Triton kernels compiled for sm_{arch} (triton {triton.__version__})",
        "",
        "| kernel | constexprs | pointer dtypes | warps | stages | regs | spill B | shared B "
        "| variants | launches |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key in sorted(groups, key=str):
        cells = " | ".join(str(v) for v in key)
        n = len(groups[key])
        lines.append(f"| {cells} | {n} | {sum(c.launches for c in groups[key])} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    p.add_argument("--models", default="qwen3-0.6b,qwen3-8b,llama-3.2-1b")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--json", default=None, help="write the table's rows here")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    compiled = check(args.arch, args.models.split(","), dtypes)
    print("\n" + markdown(compiled, args.arch))
    for c in compiled:  # slow, not wrong: reported, never a failure
        if c.local_bytes:
            print(f"note: {c.kernel} {c.constexprs} uses {c.local_bytes} B of local memory")
    found = problems(args.arch, compiled)
    for line in found:
        print("PROBLEM:", line, file=sys.stderr)
    print(f"\n{len(compiled)} kernels compiled in {time.monotonic() - t0:.0f} s")
    if args.json:
        rows = [dataclasses.asdict(c) for c in compiled]
        Path(args.json).write_text(
            json.dumps({"arch": args.arch, "triton": triton.__version__, "rows": rows}, indent=2)
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
