"""Counting a forward's device kernel launches, on the CPU: a count, never a time.

`LaunchCounter` is a context manager that records every launch made while it is open:

- aten ops, seen through a TorchDispatchMode as the dispatcher hands them to a backend (so
  `nn.Linear` is one `linear`, SDPA one `scaled_dot_product_attention`, `.contiguous()` a
  `clone` only when it copies). An op counts as one launch unless it only makes or changes
  metadata: a view (the op's schema returns an alias of an input: view, reshape as a view,
  as_strided, slice, select, split, chunk, t, transpose, unsqueeze, expand, detach, alias,
  ...), `_unsafe_view` and `_reshape_alias` (views the schema does not say are), an
  allocation that writes nothing (empty, empty_like, empty_strided, new_empty, ...) or a
  storage swap (set_, resize_). `torch.zeros` is one launch (its fill), an `index_copy_` one,
  a `.to()` that converts one and a `.to()` that does not, none.
- Triton kernels: `JITFunction.run` (a GPU launch; `warmup=True`, compile only, does not
  count) and, under TRITON_INTERPRET=1, `InterpretedFunction.run` (the interpreter's copies of
  the arguments to the host and back are not the model's launches and are not counted).

On a GPU the fused Triton path makes the same calls (not yet counted on one; a cuBLAS GEMM
that runs as two kernels on some shapes counts one here). The unfused torch path's counts are
its launches as the CPU dispatches them: on CUDA, SDPA with a mask may run more than one
kernel.
A model's first forward would also count the concatenation of its merged projections, were
they not merged at load (`MergedLinear`); an autotuned kernel (none here) would count its
benchmark launches on a GPU on first use.

Layers: given the decoder layers, the counter attributes each launch to the layer whose
`forward` / `forward_fused` it ran in (`per_layer`), the rest to the forward's own part
(`outside`: embedding, the backend's tables, RoPE inputs, final norm, head).

`python -m tokencache_models.testing.launch_counter [qwen3|qwen2|llama]` prints the table for a
small model (PATHS: prefill, catch-up and decode of two requests, and a catch-up and decode of four
requests over a shared prefix; the fused Triton path, under the interpreter when there is no GPU,
and the unfused torch path). On the Triton path the count depends on the batch only through the
attention: decode launches its kernel and the split-KV merge, a multi-token forward its kernel and
the merge only when it splits (not at these shapes; `varlen_grid` splits 10 x 10-token catch-ups at
8k on the Qwen3-8B shape), rows sharing a prefix one shared-prefix kernel more (and the merge).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import ModelConfig
from ..forward.forward_batch import ForwardBatch
from ..kv.pool import KVPool

# aten ops that launch nothing although their schema does not say they alias an input, or
# allocate without writing.
NO_LAUNCH = frozenset(
    {
        "_unsafe_view",
        "_reshape_alias",
        "alias",
        "detach",
        "lift_fresh",
        "empty",
        "empty_like",
        "empty_strided",
        "empty_permuted",
        "new_empty",
        "new_empty_strided",
        "set_",
        "resize_",
        "resize_as_",
    }
)


def launches_kernel(func: torch._ops.OpOverload) -> bool:
    """The counting rule for one aten op (the module docstring)."""
    return not func.is_view and func.overloadpacket.__name__ not in NO_LAUNCH


@dataclass
class LaunchCount:
    """One counted region: every launch by name in order, and each one's layer (None: outside
    every layer)."""

    names: list[str]
    layers: list[int | None]
    num_layers: int

    @property
    def total(self) -> int:
        return len(self.names)

    @property
    def per_layer(self) -> list[int]:
        counts = Counter(i for i in self.layers if i is not None)
        return [counts[i] for i in range(self.num_layers)]

    @property
    def outside(self) -> int:
        return sum(1 for i in self.layers if i is None)

    @property
    def kernels_per_layer(self) -> int:
        """Launches of one decoder layer (every layer launches the same; ValueError if not)."""
        per = set(self.per_layer)
        if len(per) != 1:
            raise ValueError(f"layers launch different counts: {self.per_layer}")
        return per.pop()

    def by_name(self, layer: int | None = 0) -> Counter[str]:
        """Launches of one layer (None: the forward's own part) by kernel or op name."""
        return Counter(n for n, i in zip(self.names, self.layers, strict=True) if i == layer)


class _AtenCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, owner: LaunchCounter) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.owner = owner

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if not self.owner._paused and launches_kernel(func):
            self.owner._record(f"aten.{func.overloadpacket.__name__}")
        return func(*args, **(kwargs or {}))


def _triton_launchers() -> list[type]:
    """The classes whose `run` launches a Triton kernel (none when triton is missing)."""
    try:
        from triton.runtime import interpreter, jit
    except ImportError:
        return []
    return [jit.JITFunction, interpreter.InterpretedFunction]


class LaunchCounter:
    """Counts device kernel launches while open (the rule: the module docstring).

    layers: modules whose `forward` / `forward_fused` calls scope the launches they make
    (usually `model.model.layers`). Not thread-safe: Triton launches of other threads while
    it is open count too, and one counter at a time."""

    def __init__(self, layers: Iterable[nn.Module] = ()) -> None:
        self.layers = list(layers)
        self.names: list[str] = []
        self.where: list[int | None] = []
        self._layer: int | None = None
        self._paused = 0
        self._mode = _AtenCounter(self)
        self._undo: list[Callable[[], None]] = []

    def _record(self, name: str) -> None:
        self.names.append(name)
        self.where.append(self._layer)

    @property
    def result(self) -> LaunchCount:
        return LaunchCount(list(self.names), list(self.where), len(self.layers))

    def __enter__(self) -> LaunchCounter:
        for cls in _triton_launchers():
            self._patch_triton(cls)
        for i, layer in enumerate(self.layers):
            for name in ("forward", "forward_fused"):
                if hasattr(layer, name):
                    self._scope_method(layer, name, i)
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._mode.__exit__(exc_type, exc, tb)  # type: ignore[no-untyped-call]
        while self._undo:
            self._undo.pop()()

    def _patch_triton(self, cls: type) -> None:
        original = cls.__dict__["run"]
        counter = self

        def run(fn: Any, *args: Any, **kwargs: Any) -> Any:
            if not kwargs.get("warmup", False) and not counter._paused:
                kernel = getattr(getattr(fn, "fn", None), "__name__", "?")
                counter._record(f"triton.{kernel}")
            # The interpreter's own tensor copies (arguments to the host and back) are no
            # launches of the model's.
            counter._paused += 1
            try:
                return original(fn, *args, **kwargs)
            finally:
                counter._paused -= 1

        cls.run = run  # type: ignore[attr-defined]

        def undo() -> None:
            cls.run = original  # type: ignore[attr-defined]

        self._undo.append(undo)

    def _scope_method(self, layer: nn.Module, name: str, index: int) -> None:
        original = getattr(layer, name)
        counter = self

        def scoped(*args: Any, **kwargs: Any) -> Any:
            outer, counter._layer = counter._layer, index
            try:
                return original(*args, **kwargs)
            finally:
                counter._layer = outer

        # The instance's attribute shadows the class's method (Module.__call__ reads
        # self.forward); removing it restores the method.
        layer.__dict__[name] = scoped
        self._undo.append(lambda: layer.__dict__.pop(name, None))


@contextmanager
def count_launches(layers: Iterable[nn.Module] = ()) -> Iterator[LaunchCounter]:
    with LaunchCounter(layers) as counter:
        yield counter


# -- the table: a small Qwen3 through decode, catch-up and prefill ------------------------------

PATHS = (
    "prefill",
    "catch-up",
    "decode",
    "catch-up, shared prefix",
    "decode, shared prefix",
)


def small_config(model_type: str = "qwen3", num_layers: int = 2) -> ModelConfig:
    """A few-heads Qwen3 (or another family) shape, fast under the interpreter."""
    from ..config import QWEN3_0_6B

    return dataclasses.replace(
        QWEN3_0_6B,
        model_type=model_type,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )


def _batches(pool: KVPool) -> dict[str, ForwardBatch]:
    """PATHS' forwards, in order over one pool: two requests' prefill (9 and 4 prompt tokens),
    a catch-up of 3 new tokens each over that, a decode step; then four requests over one
    256-slot prefix (the Triton path reads it once for all: the shared-prefix kernel), a
    catch-up of 3 tokens each and a decode step."""
    from ..forward.forward_batch import ForwardBatch

    a, b = pool.alloc(9), pool.alloc(4)
    a2, b2 = pool.alloc(3), pool.alloc(3)
    shared = pool.alloc(256)
    own = [pool.alloc(4) for _ in range(4)]
    new = [pool.alloc(3) for _ in range(4)]
    over = [torch.cat((shared, o)) for o in own]
    return {
        "prefill": ForwardBatch.from_requests([list(range(9)), [1, 2, 3, 4]], [[], []], [a, b]),
        "catch-up": ForwardBatch.from_requests([[5, 6, 7], [8, 9, 10]], [a, b], [a2, b2]),
        "decode": ForwardBatch.from_requests(
            [[11], [12]], [torch.cat((a, a2)), torch.cat((b, b2))], [pool.alloc(1), pool.alloc(1)]
        ),
        "catch-up, shared prefix": ForwardBatch.from_requests([[1, 2, 3]] * 4, over, new),
        "decode, shared prefix": ForwardBatch.from_requests(
            [[4]] * 4,
            [torch.cat((p, n)) for p, n in zip(over, new, strict=True)],
            [pool.alloc(1) for _ in range(4)],
        ),
    }


def count_paths(
    fused: bool, backend: str, model_type: str = "qwen3", num_layers: int = 2
) -> dict[str, LaunchCount]:
    """The launches of each of PATHS' forwards on a small random model (its projections merged
    at load, so no forward is the first to merge them). Each forward body (`model.run` over a
    built context) is counted: the context's one copy to the device is not in it."""
    from ..loader import random_model

    model = random_model(
        small_config(model_type, num_layers), seed=0, std=0.2, attention_backend=backend
    )
    model.fused = fused
    attn = model.attention()
    pool = model.make_kv_pool(512)
    counts: dict[str, LaunchCount] = {}
    for path, batch in _batches(pool).items():
        ctx = model.executor.build_context(batch, pool, attn)
        with count_launches(model.model.layers) as c:
            model.run(ctx, pool, attn)
        counts[path] = c.result
    return counts


def table(model_type: str = "qwen3") -> list[tuple[str, str, int, int, int]]:
    """Rows (path, forward, per layer, outside the layers, per forward) of the small model:
    the fused Triton path and the unfused torch path."""
    rows = []
    for label, fused, backend in (("fused, triton", True, "triton"), ("torch", False, "torch")):
        for path, c in count_paths(fused, backend, model_type).items():
            rows.append((label, path, c.kernels_per_layer, c.outside, c.total))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    model_type = args[0] if args else "qwen3"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        # Off a GPU the Triton kernels run in the interpreter, which must be on before triton
        # is imported: a fresh process.
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        cmd = [sys.executable, "-m", "tokencache_models.testing.launch_counter", *args]
        raise SystemExit(subprocess.run(cmd, env=env, check=False).returncode)
    cfg = small_config(model_type)
    print(
        f"kernel launches of a {model_type} forward body ({cfg.num_hidden_layers} layers; "
        "counted on the CPU)"
    )
    print(f"{'path':<15}{'forward':<25}{'per layer':>10}{'outside':>9}{'per forward':>13}")
    for label, path, per_layer, outside, total in table(model_type):
        print(f"{label:<15}{path:<25}{per_layer:>10}{outside:>9}{total:>13}")


if __name__ == "__main__":
    main()
