"""The static buffers a graph runner loads each step and its CUDA graphs read, and the replay.

Both runners (decode_graphs.DecodeGraphRunner, extend_graphs.ExtendGraphRunner) keep a step's
inputs in one packed int64 device buffer, split into the views a captured graph reads, and fill
it with one host -> device copy a step; the slot lists live in a buffer of their own, or in a
slot table read in place. StaticBufferRunner holds that, the deferred tokens' resolution, the
graphs by key, their capture and replay; a runner adds its layout, its keys and its forward.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import torch

from ..forward.context import (
    DeferredTokens,
    ForwardContext,
    ForwardOutput,
    HostBatch,
    SharedPrefix,
    to_device,
)
from ..forward.epilogue import Epilogue

if TYPE_CHECKING:
    from ..attention import TorchPagedAttention
    from ..kv.pool import KVPool
    from ..kv.slot_table import SlotTable
    from .decode_graphs import ForwardBody

# A graph's key: a tuple of ints (its shapes, its slot source) and the epilogue it runs.
KeyT = TypeVar("KeyT", bound=tuple[Any, ...])


@dataclass(frozen=True)
class GraphStep(Generic[KeyT]):
    """A step loaded into a runner's static buffers, ready to replay."""

    num_real: int
    key: KeyT


def _contiguous(dest: np.ndarray) -> bool:
    """dest is a, a + 1, ..., a + len - 1 (ascending, no gap)."""
    m = len(dest)
    if m < 2:
        return m == 1
    if int(dest[-1]) - int(dest[0]) != m - 1:
        return False
    return bool((dest[1:] - dest[:-1] == 1).all())


def write_deferred(
    tokens: torch.Tensor,
    deferred: DeferredTokens,
    index: torch.Tensor,
    dest: torch.Tensor,
    views: dict[int, torch.Tensor],
) -> None:
    """tokens[dest] = source[index] into a runner's static token buffer, on the device, after
    the packed copy that brought `index` and `dest` and BEFORE the replay, outside the graph
    (stream order makes the replay see it; the host waits for nothing). Not inside the graph:
    `source` is a new tensor every step (the previous step's samples) and a graph would replay
    the address it captured; a static source buffer would cost the same gather to fill, and m
    varies per step, so the graphs and their keys stay as they are. views: the runner's kept
    slices tokens[:m], by m."""
    m = len(deferred)
    if deferred.in_place:  # token i is source[i], for every i < m: one copy
        view = views.get(m)
        if view is None:  # one slice per batch size, kept: a step makes no view
            view = views[m] = tokens[:m]
        view.copy_(deferred.source)
    elif _contiguous(deferred.dest):  # a run of rows (the overlapped scheduler's continuing
        # rows, after the fresh ones): gathered straight into it, one op
        first = int(deferred.dest[0])
        torch.index_select(deferred.source, 0, index[:m], out=tokens[first : first + m])
    else:
        tokens.index_copy_(0, dest[:m], deferred.gather(index[:m]))


def capture_graph(
    body: Callable[[], ForwardOutput], mempool: Any
) -> tuple[torch.cuda.CUDAGraph, ForwardOutput]:
    """body's warm-up run (Triton compiles, cuBLAS plans) on a side stream, then its capture
    into a graph in `mempool`. Both run on whatever the buffers hold: the current step or
    padding rows, so the only K/V writes are the ones the replay makes anyway. One capture at a
    time in the process: entering a capture synchronises the device and empties the cache,
    which would invalidate a capture another thread (the routing engine's other model) has
    under way."""
    with _CAPTURE_LOCK:
        return _capture(body, mempool)


_CAPTURE_LOCK = threading.Lock()


def _capture(
    body: Callable[[], ForwardOutput], mempool: Any
) -> tuple[torch.cuda.CUDAGraph, ForwardOutput]:
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the routing engine's threaded mode runs the other model meanwhile.
    with torch.cuda.graph(graph, pool=mempool, capture_error_mode="thread_local"):
        out = body()
    return graph, out


class StaticBufferRunner(Generic[KeyT]):
    """Forwards of one (pool, attention backend) through static buffers, replayed from CUDA
    graphs captured per key (one memory pool for all of them). A runner lays its inputs out
    (`layout`: the lengths of the packed buffer's parts), sets the views below (most of them
    `_split()`'s), and gives its keys' forward (`_forward`) and where a key holds its slot
    source (`source_field`)."""

    source_field: int  # the key's position of the slot source (_slot_source)
    # The views every layout has: per token, per row (q offsets: rows + 1), deferred tokens.
    _tokens: torch.Tensor
    _positions: torch.Tensor
    _out_slots: torch.Tensor
    _q_offsets: torch.Tensor
    _kv_starts: torch.Tensor
    _kv_lens: torch.Tensor
    _last_token: torch.Tensor
    _deferred_index: torch.Tensor
    _deferred_dest: torch.Tensor

    def __init__(
        self,
        model: ForwardBody,
        pool: KVPool,
        backend: TorchPagedAttention,
        layout: Sequence[int],
        kv_capacity: int,
        use_graphs: bool | None,
    ) -> None:
        # The executor keeps its runners by pool, weakly (ModelExecutor); a weak reference back
        # keeps the pool, the graphs and their memory freeable together when the caller drops
        # the pool.
        self._pool = weakref.ref(pool)
        self.model, self.backend = model, backend
        device = model.device
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.kv_capacity = kv_capacity
        # The torch path's gather width is part of its graphs' shapes; Triton's is not.
        self.width_keyed = backend.name == "torch"
        # The step's inputs, packed in one buffer so that a step loads them in one copy.
        self._layout = tuple(layout)
        self._inputs = torch.zeros(sum(self._layout), dtype=torch.int64, device=device)
        self._starts: list[int] = np.cumsum((0, *self._layout[:-1])).tolist()
        # A step's slot list when it brings one (ForwardBatch); a slot table is read in place.
        self._kv_slots = torch.zeros(kv_capacity, dtype=torch.int64, device=device)
        # Off the CPU the host fills a copy of the buffer (pinned on CUDA; two, alternating:
        # one may still be copying while the next step fills the other); on the CPU the
        # buffer itself.
        self._staging = [
            torch.zeros(len(self._inputs), dtype=torch.int64, pin_memory=device.type == "cuda")
            for _ in range(0 if device.type == "cpu" else 2)
        ]
        self._next_staging = 0
        # Their numpy views, made once (a view per step costs more than the writes into it).
        self._host = [s.numpy() for s in self._staging] or [self._inputs.numpy()]
        self._token_views: dict[int, torch.Tensor] = {}  # _tokens[:m], by m
        self._graphs: dict[KeyT, tuple[Any, ForwardOutput]] = {}
        self._table: SlotTable | None = None  # the slot table the table-keyed graphs read
        self._mempool: Any = None
        self.replays = 0  # steps served by a graph (tests and benches read it)
        self.captures = 0  # graphs captured so far
        # Warm-up (capture_all): the keys made ready, and the steps since that came outside
        # them (a capture, or on CUDA a compile, while serving).
        self.warm_keys: set[KeyT] = set()
        self.cold_runs = 0

    @property
    def pool(self) -> KVPool:
        pool = self._pool()
        if pool is None:
            raise RuntimeError("the KV pool of this graph runner no longer exists")
        return pool

    def _split(self) -> tuple[torch.Tensor, ...]:
        """The packed buffer's parts, as device views in the layout's order."""
        return torch.split(self._inputs, list(self._layout))

    # -- a step's load -------------------------------------------------------------------

    def _host_inputs(self) -> np.ndarray:
        """Where the host writes the next step's packed inputs."""
        return self._host[self._next_staging]

    def _copy_in(self) -> None:
        """The packed inputs to the device in one copy (written in place on the CPU)."""
        if self._staging:
            self._inputs.copy_(self._staging[self._next_staging], non_blocking=True)
            self._next_staging ^= 1

    def _load_step(self, hb: HostBatch) -> None:
        """The packed inputs in one copy, the deferred tokens resolved on the device after it,
        the slot table's queued writes or the step's own slot list apart."""
        self._copy_in()
        deferred = hb.deferred
        if deferred is not None and len(deferred):
            write_deferred(
                self._tokens, deferred, self._deferred_index, self._deferred_dest, self._token_views
            )
        if hb.table is None:
            (slots,) = to_device([hb.kv_slots], self._kv_slots.device)
            self._kv_slots[: slots.numel()].copy_(slots)  # the step's own slot list
        else:
            writes = hb.table.take_writes()
            if writes is not None:  # the table's new entries (O(new tokens))
                flat, vals = to_device(list(writes), self._kv_slots.device)
                hb.table.flat.index_copy_(0, flat, vals)

    def _slot_source(self, table: SlotTable | None) -> int:
        """Which slot buffer a graph reads, part of its key: 0, the runner's own (slot lists
        copied in per step); else the table's storage generation (a table that grew has moved,
        or another table came: graphs over its old storage are dropped)."""
        if table is None:
            return 0
        if table is not self._table:
            field = self.source_field
            self._graphs = {k: v for k, v in self._graphs.items() if k[field] == 0}
            self._table = table
        return table.generation

    def _slot_buffer(self, source: int) -> torch.Tensor:
        if source == 0:
            return self._kv_slots
        assert self._table is not None and self._table.generation == source
        return self._table.flat

    def _buffer_context(
        self,
        rows: int,
        tokens: int,
        source: int,
        *,
        max_q_len: int,
        kv_width: int,
        is_decode: bool,
        prefix: SharedPrefix | None = None,
        q_width: int = 0,
        splits: int | None = None,
    ) -> ForwardContext:
        """A context whose tensors are views of the static buffers: `rows` rows, `tokens`
        tokens, over the runner's slot buffer (source 0) or the slot table's (_slot_source)."""
        return ForwardContext(
            num_requests=rows,
            num_real=rows,
            num_tokens=tokens,
            max_q_len=max_q_len,
            kv_width=kv_width,
            is_decode=is_decode,
            token_ids=self._tokens[:tokens],
            positions=self._positions[:tokens],
            out_slots=self._out_slots[:tokens],
            kv_slots=self._slot_buffer(source),
            q_offsets=self._q_offsets[: rows + 1],
            kv_starts=self._kv_starts[:rows],
            kv_lens=self._kv_lens[:rows],
            last_token=self._last_token[:rows],
            scratch_slot=self.pool.scratch_slot,
            prefix=prefix,
            q_width=q_width,
            splits=splits,
        )

    # -- the device work -----------------------------------------------------------------

    def prepare(self, hb: HostBatch, epilogue: Epilogue | None = None) -> GraphStep[KeyT]:
        raise NotImplementedError

    def _forward(self, key: KeyT) -> ForwardOutput:
        """The static path's device work for `key`, what its graph captures: the forward over
        the static buffers, then the epilogue on its logits."""
        raise NotImplementedError

    @torch.inference_mode()
    def run(self, hb: HostBatch, epilogue: Epilogue | None = None) -> ForwardOutput:
        """One forward of hb through the padded static path (graph replay when use_graphs).
        Returns the real rows' outputs (copies, not the static buffers)."""
        return self.execute(self.prepare(hb, epilogue))

    @torch.inference_mode()
    def execute(self, step: GraphStep[KeyT]) -> ForwardOutput:
        """The step's device work: the graph's replay (or the static path run eagerly)."""
        if self.warm_keys and step.key not in self.warm_keys:
            self.cold_runs += 1
        if self.use_graphs:
            graph, out = self._graphs.get(step.key) or self._capture(step.key)
            graph.replay()
            self.replays += 1
        else:
            out = self._forward(step.key)
        b = step.num_real
        return out.each(lambda t: t[:b].clone())  # copies: the next replay overwrites them

    def _capture(self, key: KeyT) -> tuple[Any, ForwardOutput]:
        """The graph of this key (capture_graph), held from now on."""
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        entry = self._graphs[key] = capture_graph(lambda: self._forward(key), self._mempool)
        self.captures += 1
        return entry

    def _warm(
        self,
        keys: Sequence[KeyT],
        progress: Callable[[int, int], None] | None,
        load: Callable[[KeyT], None] | None = None,
    ) -> int:
        """capture_all's loop: each key not held yet captured (after `load` fills the buffers
        for it), or its static path run once off CUDA; every key warm from now on. Returns the
        number of graphs held."""
        for i, key in enumerate(keys):
            if key not in self._graphs:
                if load is not None:
                    load(key)
                if self.use_graphs:
                    self._capture(key)
                else:
                    self._forward(key)
            self.warm_keys.add(key)
            if progress is not None:
                progress(i + 1, len(keys))
        return len(self._graphs)
