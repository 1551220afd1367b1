"""The model executor: how one model's forwards run, beside the network that computes them.

nano-vllm's ModelRunner is the anchor. The network (model.CausalLM) is the layers and one
forward body, `run(ctx, pool, backend)`, over a context built before it; the executor owns
everything about HOW a forward runs:

- its host work (`prepare`): lengths, padding rows, the attention backend's host plan, the
  shared-prefix tables, the one packed copy to the device; a decode step that fits a graph
  runner is loaded into that runner's static buffers instead;
- the choice of path: eager, eager over a decode batch padded to a bucket (`decode_padding`,
  default on CUDA), or the replay of the CUDA graph captured for that bucket (`decode_graphs`);
- the graph runners (decode_graphs.DecodeGraphRunner), one per (pool, attention backend), held by
  pool weakly: dropping a pool frees its graphs;
- its device work (`execute`): the replay or the network's body; under tensor parallelism it
  first sends the step's metadata to the worker ranks (model.tp).

Every model has one (`model.executor`); `model.prepare` / `model.execute` / `model(...)` are
delegations to it. Dependencies point one way: model -> executor -> graphs -> context (the
executor and the graph runners see the network through the Network / ForwardBody protocols).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..forward.context import (
    DEFAULT_DECODE_BUCKETS,
    KV_CHUNK,
    ForwardContext,
    ForwardOutput,
    HostBatch,
    decode_bucket,
    decode_kv_width,
)
from ..forward.epilogue import Epilogue
from ..forward.forward_batch import ForwardBatch
from ..kv.pool import KVPool
from ..shared_prefix.groups import MAX_PREFIX_GROUPS
from ..shared_prefix.shape import PrefixShape
from .decode_graphs import DecodeGraphRunner, ForwardBody, StaticStep
from .extend_graphs import (
    DEFAULT_EXTEND_ROWS,
    DEFAULT_EXTEND_TOKENS,
    ExtendGraphRunner,
    ExtendStep,
)

if TYPE_CHECKING:
    from ..attention import TorchPagedAttention
    from ..kv.slot_table import SlotTable
    from ..parallel.tp_layers import TPGroup


class TPHooks(Protocol):
    """A tensor-parallel runtime on a model shard (parallel.runtime.TPDriver on the engine's rank):
    pools it makes and forwards it runs are mirrored on the worker ranks."""

    def pool_made(self, pool: KVPool) -> None: ...

    def prepared(self, hb: HostBatch, pool: KVPool, backend: str) -> Any: ...

    def executing(self, payload: Any) -> None: ...

    def fail(self, exc: BaseException) -> BaseException: ...


class Network(ForwardBody, Protocol):
    """What the executor needs of the network (model.CausalLM) beyond its forward body: its
    attention backends (built once per model) and its tensor-parallel place and runtime."""

    tp: TPHooks | None
    tp_group: TPGroup | None

    def attention(self, name: str | None = None) -> TorchPagedAttention: ...


@dataclass(frozen=True)
class PreparedStep:
    """A forward whose host work is done (ModelExecutor.prepare): an eager context, or a
    decode or multi-token step loaded into a graph runner's static buffers."""

    pool: KVPool
    backend: TorchPagedAttention
    context: ForwardContext | None = None
    static: StaticStep | None = None
    runner: DecodeGraphRunner | None = None
    extend: ExtendStep | None = None
    extend_runner: ExtendGraphRunner | None = None
    # What the forward computes from its logits on the device (greedy tokens, entropy)
    epilogue: Epilogue | None = None
    # Tensor parallelism: what the engine's rank sends its workers when it runs this step.
    tp_payload: Any = None


class ModelExecutor:
    """Runs one model's forwards: chooses eager, padded or graph replay, owns the graph runners.

    Switches (CUDA only; every rank of a tensor-parallel model must agree on them):
    decode_padding pads decode batches to a bucket (None: on when the model is on CUDA),
    decode_graphs replays CUDA graphs for them, decode_buckets the bucket sizes.
    decode_runner (None: on CUDA) loads decode steps into a graph runner's static buffers;
    True off CUDA runs that static path without capturing (the host-path benchmarks' stub).
    extend_graphs replays multi-token forwards (catch-ups, short prefill chunks) from CUDA
    graphs (extend_graphs.ExtendGraphRunner) within extend_rows x extend_tokens; extend_runner
    (None: on CUDA) as decode_runner, True off CUDA runs their static path without capturing.

    `forwards` counts the forwards executed by path ("decode graph", "extend graph", "decode
    eager", "extend eager"; "static" for a runner's path run without capture, off CUDA):
    graph coverage as a number (the routing engine's Stats and benchmarks read it).
    """

    def __init__(self, model: Network) -> None:
        self.model = model
        self.decode_padding: bool | None = None
        self.decode_graphs = True
        self.decode_runner: bool | None = None
        self.decode_buckets: tuple[int, ...] = DEFAULT_DECODE_BUCKETS
        self.extend_graphs = True
        self.extend_runner: bool | None = None
        self.extend_rows: tuple[int, ...] = DEFAULT_EXTEND_ROWS
        self.extend_tokens: tuple[int, ...] = DEFAULT_EXTEND_TOKENS
        self.forwards: Counter[str] = Counter()
        # pool -> {backend name: runner}; weak, so a dropped pool frees its runners and graphs.
        self._runners: weakref.WeakKeyDictionary[KVPool, dict[str, DecodeGraphRunner]] = (
            weakref.WeakKeyDictionary()
        )
        self._extend_runners: weakref.WeakKeyDictionary[KVPool, dict[str, ExtendGraphRunner]] = (
            weakref.WeakKeyDictionary()
        )

    def __getstate__(self) -> dict[str, object]:
        """Pickled with its model (a tensor-parallel worker gets the model through a spawn):
        the switches travel, the graph runners (bound to this process's pools and device
        memory) do not."""
        state = dict(self.__dict__)
        state["_runners"] = state["_extend_runners"] = None
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._runners = weakref.WeakKeyDictionary()
        self._extend_runners = weakref.WeakKeyDictionary()

    def pads_decode(self) -> bool:
        if self.decode_padding is not None:
            return self.decode_padding
        return self.model.device.type == "cuda"

    def graph_runner(self, pool: KVPool, backend: TorchPagedAttention) -> DecodeGraphRunner | None:
        """The CUDA-graph decode runner of (pool, backend), made on first use (capturing only
        on CUDA); None when the model is not on CUDA and decode_runner is not set. Decode steps
        use it while decode_graphs is on."""
        use = self.decode_runner
        if not (self.model.device.type == "cuda" if use is None else use):
            return None
        runners = self._runners.setdefault(pool, {})
        runner = runners.get(backend.name)
        if runner is None:
            runner = DecodeGraphRunner(self.model, pool, backend, self.decode_buckets)
            runners[backend.name] = runner
        return runner

    def extend_graph_runner(
        self, pool: KVPool, backend: TorchPagedAttention
    ) -> ExtendGraphRunner | None:
        """The multi-token graph runner of (pool, backend), made on first use (capturing only
        on CUDA); None while extend_graphs is off, or off CUDA unless extend_runner is set."""
        use = self.extend_runner
        if not self.extend_graphs or not (self.model.device.type == "cuda" if use is None else use):
            return None
        runners = self._extend_runners.setdefault(pool, {})
        runner = runners.get(backend.name)
        if runner is None:
            runner = ExtendGraphRunner(
                self.model, pool, backend, self.extend_rows, self.extend_tokens
            )
            runners[backend.name] = runner
        return runner

    def prepare_runner(
        self, pool: KVPool, attention_backend: str | None = None
    ) -> DecodeGraphRunner | None:
        """The decode graph runner of pool (and the model's attention backend, or the one
        named) made now, as a server makes it at startup, so that the first decode step does
        not pay for its static buffers; None where decode steps take no runner (graphs off,
        decode not padded, not on CUDA). Its graphs are still captured on first use of each
        key (decode_graphs.DecodeGraphRunner.capture_all captures them ahead). Its static buffers
        (a kv_capacity slot list, ~16 MiB, and pinned staging) are held from now on, also
        for a model that never decodes (the routing engine's large side)."""
        if not (self.decode_graphs and self.pads_decode()):
            return None
        return self.graph_runner(pool, self.model.attention(attention_backend))

    @torch.inference_mode()
    def warm_up(
        self,
        pool: KVPool,
        epilogue: Epilogue | None = None,
        table: SlotTable | None = None,
        max_rows: int | None = None,
        max_tokens: int | None = None,
        max_context: int = 1,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Makes every graph the forwards over `pool` can replay, before they come: decode
        steps of up to max_rows rows (every bucket, every shared-prefix group count) and
        multi-token forwards of up to max_rows rows and max_tokens tokens, with the epilogue
        the steps will ask for, over the slot table they will read (its storage reserved
        first: SlotTable.reserve); the torch path at every gather width up to max_context.
        Each graph's warm-up run is its Triton compiles. Off CUDA (runners' static paths
        switched on) each key's static path runs once. Returns the number of keys made warm;
        the runners' cold_runs count the forwards that come outside them."""
        backend = self.model.attention()
        widths = [KV_CHUNK << k for k in range(decode_kv_width(max_context).bit_length())]
        widths = [w for w in widths if w <= decode_kv_width(max_context)]
        decode = self.prepare_runner(pool)
        extend = self.extend_graph_runner(pool, backend)
        if decode is not None:
            decode.capture_all(
                widths, MAX_PREFIX_GROUPS, epilogue, table, max_rows, progress=progress
            )
        if extend is not None:
            extend.capture_all(epilogue, table, max_rows, max_tokens, widths, progress)
        return sum(len(r.warm_keys) for r in (decode, extend) if r is not None)

    def runners(self, pool: KVPool) -> list[DecodeGraphRunner]:
        """The decode graph runners made over `pool` so far."""
        return list(self._runners.get(pool, {}).values())

    def extend_runners(self, pool: KVPool) -> list[ExtendGraphRunner]:
        """The multi-token graph runners made over `pool` so far."""
        return list(self._extend_runners.get(pool, {}).values())

    def build_context(
        self,
        batch: ForwardBatch | HostBatch,
        pool: KVPool,
        backend: TorchPagedAttention,
        pad_rows_to: int | None = None,
    ) -> ForwardContext:
        """Host work of one eager forward (lengths, padding, the backend's host plan), one copy
        to the device. Nothing after this reads device memory back on the host."""
        shape = (
            PrefixShape.of(self.model.shard_config, pool.dtype.itemsize)
            if backend.shares_prefix
            else None
        )
        return ForwardContext.build(
            batch, self.model.device, pool.scratch_slot, backend.plan, pad_rows_to, shape
        )

    def prepare(
        self,
        batch: ForwardBatch | HostBatch,
        pool: KVPool,
        attention_backend: str | None = None,
        epilogue: Epilogue | None = None,
    ) -> PreparedStep:
        """A forward's host work (lengths, padding, prefix tables, the one copy to the device):
        what execute() then runs is device work only, the epilogue's included (in the
        decode graph on the graph path)."""
        model = self.model
        backend = model.attention(attention_backend)
        hb = batch if isinstance(batch, HostBatch) else HostBatch.from_batch(batch)
        if hb.deferred is not None and model.tp_group is not None and model.tp_group.world > 1:
            # The worker ranks would need the resolved tokens: a host sync on the engine's
            # rank, for a case that does not arise (the small model, which would take deferred
            # tokens, is never the tensor-parallel one). Refused rather than synced silently.
            raise ValueError(
                "DeferredTokens are not supported on a tensor-parallel model: resolve the "
                "tokens on the host (write them into token_ids) for its forwards"
            )
        step = self._prepare(hb, pool, backend, epilogue)
        if model.tp is not None:  # after our own host work: its prefix groups travel too
            step = dataclasses.replace(step, tp_payload=model.tp.prepared(hb, pool, backend.name))
        return step

    def _prepare(
        self,
        hb: HostBatch,
        pool: KVPool,
        backend: TorchPagedAttention,
        epilogue: Epilogue | None = None,
    ) -> PreparedStep:
        pad_to = None
        if hb.is_decode and self.pads_decode():
            pad_to = decode_bucket(hb.num_requests, self.decode_buckets)
            runner = self.graph_runner(pool, backend) if self.decode_graphs else None
            if runner is not None and pad_to is not None and runner.fits(hb):
                static = runner.prepare(hb, epilogue)
                return PreparedStep(pool, backend, static=static, runner=runner, epilogue=epilogue)
        elif not hb.is_decode:
            extend = self.extend_graph_runner(pool, backend)
            if extend is not None and extend.fits(hb):
                step = extend.prepare(hb, epilogue)
                return PreparedStep(
                    pool, backend, extend=step, extend_runner=extend, epilogue=epilogue
                )
        ctx = self.build_context(hb, pool, backend, pad_to)
        return PreparedStep(pool, backend, context=ctx, epilogue=epilogue)

    def execute(self, step: PreparedStep) -> ForwardOutput:
        """A prepared forward's device work (graph replay or the eager body); under tensor
        parallelism its metadata goes to the worker ranks first, which run it alongside."""
        if step.tp_payload is None:
            return self._execute(step)
        tp = self.model.tp
        assert tp is not None
        tp.executing(step.tp_payload)
        try:
            return self._execute(step)
        except Exception as exc:  # a collective failed: a worker rank is gone
            raise tp.fail(exc) from exc

    @staticmethod
    def path_of(step: PreparedStep) -> str:
        """How a prepared forward runs: "decode" or "extend" (multi-token), then "graph" (a
        CUDA graph's replay), "static" (a graph runner's path without capture, off CUDA) or
        "eager"."""
        if step.runner is not None:
            return "decode graph" if step.runner.use_graphs else "decode static"
        if step.extend_runner is not None:
            return "extend graph" if step.extend_runner.use_graphs else "extend static"
        assert step.context is not None
        return "decode eager" if step.context.is_decode else "extend eager"

    def _execute(self, step: PreparedStep) -> ForwardOutput:
        self.forwards[self.path_of(step)] += 1
        if step.runner is not None:
            assert step.static is not None
            return step.runner.execute(step.static)
        if step.extend_runner is not None:
            assert step.extend is not None
            return step.extend_runner.execute(step.extend)
        assert step.context is not None
        out = self.model.run(step.context, step.pool, step.backend)
        return step.epilogue.apply(out) if step.epilogue is not None else out

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch | HostBatch,
        pool: KVPool,
        attention_backend: str | None = None,
        context: ForwardContext | None = None,
    ) -> ForwardOutput:
        """One ragged batch (prefill, extend and decode requests mixed) over the pool: prepare
        then execute. A prebuilt context (build_context) may be passed instead of the batch's
        host work, and then runs eagerly."""
        if context is not None:
            if self.model.tp is not None:  # the worker ranks would never see this forward
                raise RuntimeError("a tensor-parallel model runs forwards through prepare()")
            return self.model.run(context, pool, self.model.attention(attention_backend))
        return self.execute(self.prepare(batch, pool, attention_backend))
