"""CUDA-graph decode: one graph per batch-size bucket over static input buffers.

A decode step of B requests is padded to the smallest bucket >= B (padding rows write and read
only the pool's scratch slot), its inputs are copied into static device buffers, and the graph
captured for that bucket is replayed. Capture happens on first use of a bucket (or all at once,
capture_all); every graph shares one memory pool. The padded static path without the capture
(use_graphs=False) runs anywhere, CPU included, and is what the tests compare with eager.

The graph's shapes depend on the bucket only: the Triton decode kernel reads each row's KV range
from the (static) offsets buffer, so any context fits as long as the step's slot list fits the
kv_slots buffer (kv_capacity). A step whose rows share prefixes replays the bucket's
shared-prefix graph for its number of groups (one system prompt: one group, the common case;
captured on first use), which reads the groups' tile table from buffers as well. The torch path
gathers a fixed [rows, width] block, so its graphs are keyed by (bucket, width) as well,
width = decode_kv_width(max kv length). A step's epilogue (forward/epilogue.py: greedy
tokens, entropy) is captured in its graph, so graphs are keyed by it too.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from ..forward.context import (
    KV_CHUNK,
    DeferredTokens,
    ForwardContext,
    ForwardOutput,
    HostBatch,
    SharedPrefix,
    decode_bucket,
    decode_kv_width,
    to_device,
)
from ..forward.epilogue import Epilogue
from ..shared_prefix.groups import (
    MAX_PREFIX_GROUPS,
    TILE_FIELDS,
    PrefixTables,
    max_tiles,
    prefix_tables,
)
from ..shared_prefix.shape import PrefixShape

if TYPE_CHECKING:
    from ..attention import TorchPagedAttention
    from ..config import ModelConfig
    from ..kv.pool import KVPool
    from ..kv.slot_table import SlotTable

DEFAULT_KV_CAPACITY = 256 * 8192  # slot-list entries of one decode step (shared ones count)


class ForwardBody(Protocol):
    """What a graph runner needs of the network (model.CausalLM): its device, the shapes this
    rank computes, and the forward body it captures and replays (device work only). The runner
    never chooses a path or builds runners: the executor (model_executor.ModelExecutor) does."""

    @property
    def device(self) -> torch.device: ...

    @property
    def shard_config(self) -> ModelConfig: ...

    def run(
        self, ctx: ForwardContext, pool: KVPool, backend: TorchPagedAttention
    ) -> ForwardOutput: ...


# A decode graph's key: rows (bucket), gather width, prefix groups, slot source, epilogue.
GraphKey = tuple[int, int, int, int, Epilogue | None]


@dataclass(frozen=True)
class StaticStep:
    """A decode step loaded into a runner's static buffers, ready to replay."""

    num_real: int
    key: GraphKey  # (rows, width, groups, slot source, epilogue): the graph's key


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


class DecodeGraphRunner:
    def __init__(
        self,
        model: ForwardBody,
        pool: KVPool,
        backend: TorchPagedAttention,
        buckets: Sequence[int],
        kv_capacity: int | None = None,
        use_graphs: bool | None = None,
    ) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError("buckets must be a non-empty list of positive batch sizes")
        # The executor keeps its runners by pool, weakly (ModelExecutor); a weak reference back
        # keeps the pool, the graphs and their memory freeable together when the caller drops
        # the pool.
        self._pool = weakref.ref(pool)
        self.model, self.backend = model, backend
        # This rank's shapes (a tensor-parallel shard holds its own heads).
        self.prefix_shape = PrefixShape.of(model.shard_config, pool.dtype.itemsize)
        self.buckets = tuple(sorted(set(buckets)))
        self.max_rows = self.buckets[-1]
        device = model.device
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.kv_capacity = kv_capacity or max(DEFAULT_KV_CAPACITY, self.max_rows)
        # The torch path's gather width is part of its graphs' shapes; Triton's is not.
        self.width_keyed = backend.name == "torch"
        n = self.max_rows

        def i64(x: torch.Tensor) -> torch.Tensor:
            return x.to(device=device, dtype=torch.int64)

        self._q_offsets = i64(torch.arange(n + 1))  # decode: one token per row, always
        self._last_token = i64(torch.arange(n))
        # A step's slot list when it brings one (ForwardBatch); a slot table is read in place.
        self._kv_slots = i64(torch.zeros(self.kv_capacity))
        # The step's inputs, packed in one buffer so that a step loads them in one copy:
        # tokens, positions, out slots, row starts and lengths, the shared-prefix tables
        # (shared-prefix graphs; shared_prefix.groups.PrefixTables): row skips, tiles, tokens, and
        # the deferred tokens' source indices and destinations (DeferredTokens; at most a row each).
        tiles = max_tiles(self.prefix_shape, n) * TILE_FIELDS
        self._layout = (n, n, n, n, n, n, tiles, n, n, n)
        self._inputs = i64(torch.zeros(sum(self._layout)))
        (
            self._tokens,
            self._positions,
            self._out_slots,
            self._kv_starts,
            self._kv_lens,
            self._row_skip,
            self._tiles,
            self._prefix_tokens,
            self._deferred_index,
            self._deferred_dest,
        ) = torch.split(self._inputs, list(self._layout))
        self._starts = np.cumsum((0, *self._layout[:-1])).tolist()
        # Off the CPU the host fills a copy of the buffer (pinned on CUDA; two, alternating:
        # one may still be copying while the next step fills the other); on the CPU the
        # buffer itself.
        self._staging = [
            torch.zeros(len(self._inputs), dtype=torch.int64, pin_memory=device.type == "cuda")
            for _ in range(0 if device.type == "cpu" else 2)
        ]
        self._next_staging = 0
        self._token_views: dict[int, torch.Tensor] = {}  # _tokens[:m], by m
        # Their numpy views, made once (a view per step costs more than the writes into it).
        self._inputs_host: np.ndarray | None = (
            self._inputs.numpy() if device.type == "cpu" else None
        )
        self._staging_host = [staging.numpy() for staging in self._staging]
        # The last step's prefix tables and what they were built from: steady decoding keeps
        # its groups, rows and offsets from step to step, so the tables repeat.
        self._tables_key: tuple[Any, ...] | None = None
        self._tables: PrefixTables | None = None
        self._reset()
        self._graphs: dict[GraphKey, tuple[Any, ForwardOutput]] = {}
        self._table: SlotTable | None = None  # the slot table the table-keyed graphs read
        self._mempool: Any = None
        self.replays = 0  # decode steps served by a graph (tests and benches read it)
        self.captures = 0  # graphs captured so far
        # Warm-up (capture_all): the keys made ready, and the steps since that came outside
        # them (a capture, or on CUDA a compile, while serving).
        self.warm_keys: set[GraphKey] = set()
        self.cold_runs = 0

    @property
    def pool(self) -> KVPool:
        pool = self._pool()
        if pool is None:
            raise RuntimeError("the KV pool of this graph runner no longer exists")
        return pool

    def _reset(self) -> None:
        """Every row a padding row (token 0 at position 0 over the scratch slot), no tiles (the
        prefix kernel writes nothing); built on the host, so nothing is read back."""
        scratch, n, at = self.pool.scratch_slot, self.max_rows, self._starts
        init = np.zeros(len(self._inputs), np.int64)
        init[at[2] : at[2] + n] = scratch  # out slots
        init[at[3] : at[3] + n] = np.arange(n)  # row starts: entry i of the slot buffer
        init[at[4] : at[4] + n] = 1  # row lengths
        packed = torch.from_numpy(init)
        self._inputs.copy_(packed)
        for staging in self._staging:
            staging.copy_(packed)
        self._kv_slots[:n].fill_(scratch)

    def bucket(self, batch: int) -> int | None:
        return decode_bucket(batch, self.buckets)

    def fits(self, hb: HostBatch) -> bool:
        """Decode batch within the largest bucket; a step bringing its own slot list needs it
        to fit the buffer once padded (a slot table is read where it is)."""
        rows = self.bucket(hb.num_requests)
        if rows is None or not hb.is_decode:
            return False
        if hb.table is not None:
            return hb.table.device == self._tokens.device
        return len(hb.kv_slots) + 1 <= self.kv_capacity

    def _slot_source(self, table: SlotTable | None) -> int:
        """Which slot buffer a graph reads, part of its key: 0, the runner's own (slot lists
        copied in per step); else the table's storage generation (a table that grew has moved:
        graphs over its old storage are dropped)."""
        if table is None:
            return 0
        if table is not self._table:
            self._graphs = {k: v for k, v in self._graphs.items() if k[3] == 0}
            self._table = table
        return table.generation

    def _slot_buffer(self, source: int) -> torch.Tensor:
        if source == 0:
            return self._kv_slots
        assert self._table is not None and self._table.generation == source
        return self._table.flat

    def static_context(
        self, rows: int, kv_width: int, groups: int = 0, source: int = 0
    ) -> ForwardContext:
        """A context whose tensors are (views of) the static buffers, for `rows` rows; with the
        shared-prefix path for `groups` groups when > 0 (their tables come from buffers); over
        the runner's slot buffer (source 0) or the slot table's (_slot_source)."""
        prefix = None
        if groups:
            tiles = max_tiles(self.prefix_shape, rows, groups) * TILE_FIELDS
            prefix = SharedPrefix(
                self._row_skip[:rows],
                self._tiles[:tiles],
                self._prefix_tokens[:rows],
                self.prefix_shape.tokens_per_block,
            )
        return ForwardContext(
            num_requests=rows,
            num_real=rows,
            num_tokens=rows,
            max_q_len=1,
            kv_width=kv_width,
            is_decode=True,
            token_ids=self._tokens[:rows],
            positions=self._positions[:rows],
            out_slots=self._out_slots[:rows],
            kv_slots=self._slot_buffer(source),
            q_offsets=self._q_offsets[: rows + 1],
            kv_starts=self._kv_starts[:rows],
            kv_lens=self._kv_lens[:rows],
            last_token=self._last_token[:rows],
            scratch_slot=self.pool.scratch_slot,
            prefix=prefix,
        )

    def _load(self, hb: HostBatch, tables: PrefixTables | None) -> None:
        """The padded step into the static buffers: its inputs in one copy of the packed buffer
        (written in place on the CPU), the slot table's queued writes (or a step's own slot
        list) apart. Rows past the bucket and slot-list entries past its end are never read."""
        rows = hb.num_requests
        if self._staging:
            staging = self._staging[self._next_staging]
            host = self._staging_host[self._next_staging]
            self._next_staging ^= 1
        else:
            assert self._inputs_host is not None  # no staging: the CPU's own buffer
            host = self._inputs_host
        at = self._starts
        parts = [hb.token_ids, hb.positions, hb.out_slots, hb.kv_starts, hb.kv_lens]
        for k, a in enumerate(parts):
            host[at[k] : at[k] + rows] = a
        if tables is not None:
            host[at[5] : at[5] + rows] = tables.row_skip
            tiles = tables.tiles.reshape(-1)
            host[at[6] : at[6] + len(tiles)] = tiles
            host[at[7] : at[7] + len(tables.tokens)] = tables.tokens
        deferred = hb.deferred
        m = len(deferred) if deferred is not None else 0
        if deferred is not None:
            deferred.check_device(self._tokens.device)
            if not deferred.in_place:  # in place: a plain copy below, no index
                host[at[8] : at[8] + m] = deferred.index
                host[at[9] : at[9] + m] = deferred.dest
            elif deferred.source.shape[0] != m:  # a host-known shape: no sync
                raise ValueError(
                    f"DeferredTokens.in_place: a source of {deferred.source.shape[0]} tokens "
                    f"for {m} destinations"
                )
        if self._staging:
            self._inputs.copy_(staging, non_blocking=True)
        if deferred is not None and m:
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

    @torch.inference_mode()
    def run(self, hb: HostBatch, epilogue: Epilogue | None = None) -> ForwardOutput:
        """One decode step of hb's requests through the padded static path (graph replay when
        use_graphs). Returns the real rows' outputs (copies, not the static buffers)."""
        return self.execute(self.prepare(hb, epilogue))

    def prepare(self, hb: HostBatch, epilogue: Epilogue | None = None) -> StaticStep:
        """The step's host work: padding, prefix tables, one copy into the static buffers.
        The epilogue (greedy tokens, entropy) runs in the step's graph."""
        if not self.fits(hb):
            raise ValueError("decode batch does not fit the graph runner (see fits)")
        b = hb.num_requests
        rows = self.bucket(b)
        assert rows is not None
        hbp = hb.padded(rows, self.pool.scratch_slot)
        width = decode_kv_width(int(hbp.kv_lens.max()))
        tables = self._prefix_tables(hbp) if self.backend.shares_prefix else None
        n = len(tables.groups) if tables is not None else 0
        source = self._slot_source(hb.table)
        self._load(hbp, tables)
        return StaticStep(b, self._key(rows, width, n, source, epilogue))

    def _prefix_tables(self, hbp: HostBatch) -> PrefixTables | None:
        """The padded step's shared-prefix tables (HostBatch.prefix_groups' groups), None when
        no group pays. Built again only when the candidate groups, rows or offsets changed
        since the last step: steady decoding keeps them, and its tables repeat."""
        key = (tuple(hbp.candidate_groups()), hbp.q_offsets.tobytes(), hbp.kv_starts.tobytes())
        if key != self._tables_key:
            groups = hbp.prefix_groups(self.prefix_shape)  # the candidates kept on hbp
            tables = None
            if groups:
                tiles = max_tiles(self.prefix_shape, hbp.num_requests, len(groups))
                tables = prefix_tables(
                    groups, hbp.q_offsets, hbp.kv_starts, self.prefix_shape, tiles
                )
            self._tables_key, self._tables = key, tables
        return self._tables

    @torch.inference_mode()
    def execute(self, step: StaticStep) -> ForwardOutput:
        """The step's device work: the graph's replay (or the static path run eagerly)."""
        if self.warm_keys and step.key not in self.warm_keys:
            self.cold_runs += 1
        if self.use_graphs:
            graph, out = self._graphs.get(step.key) or self._capture(*step.key)
            graph.replay()
            self.replays += 1
        else:
            out = self._body(*step.key)
        b = step.num_real
        return out.each(lambda t: t[:b].clone())  # copies: the next replay overwrites them

    def _body(
        self, rows: int, width: int, groups: int, source: int, epilogue: Epilogue | None
    ) -> ForwardOutput:
        """The static path's device work, what a graph captures: the forward over the static
        buffers, then the epilogue on its logits."""
        ctx = self.static_context(rows, width, groups, source)
        out = self.model.run(ctx, self.pool, self.backend)
        return epilogue.apply(out) if epilogue is not None else out

    def _key(
        self,
        rows: int,
        width: int,
        groups: int = 0,
        source: int = 0,
        epilogue: Epilogue | None = None,
    ) -> GraphKey:
        """A graph per bucket, per gather width on the torch path, per prefix group count
        (0: without the shared-prefix kernel, so a batch without a shared prefix does not pay
        for it; g: a tile table for g groups, so one group does not pay for eight), per slot
        buffer (_slot_source), per epilogue."""
        return (rows, width if self.width_keyed else 0, groups, source, epilogue)

    def _capture(
        self,
        rows: int,
        width: int,
        groups: int = 0,
        source: int = 0,
        epilogue: Epilogue | None = None,
    ) -> tuple[Any, ForwardOutput]:
        """The graph of this key (capture_graph), held from now on."""
        key = (rows, width, groups, source, epilogue)  # the prefix tables are in their buffers
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        entry = capture_graph(lambda: self._body(*key), self._mempool)
        self._graphs[self._key(*key)] = entry
        self.captures += 1
        return entry

    @torch.inference_mode()
    def capture_all(
        self,
        widths: Sequence[int] = (KV_CHUNK,),
        max_groups: int = 1,
        epilogue: Epilogue | None = None,
        table: SlotTable | None = None,
        max_rows: int | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Captures every bucket up to max_rows' (largest first, so smaller graphs reuse its
        pool memory); the torch path once per given gather width; without the shared-prefix
        kernel and, when the backend has one, with it for 1..max_groups groups (more groups
        are captured on first use); each with the given epilogue (the one the steps will ask
        for), over the slot table the steps will read (None: the runner's own buffer).
        Off CUDA (use_graphs False) each key's static path runs once instead: the warm-up
        without a capture. Either way the keys count as warm from now on (cold_runs counts the
        steps that come outside them). progress(done, total) after each. Returns the number of
        graphs held."""
        self._reset()
        source = self._slot_source(table)
        shares = self.backend.shares_prefix
        top = self.bucket(max_rows or self.max_rows) or self.max_rows
        keys = [
            self._key(rows, w, groups, source, epilogue)
            for groups in range(min(max_groups, MAX_PREFIX_GROUPS) + 1 if shares else 1)
            for w in (widths if self.width_keyed else widths[:1])
            for rows in reversed(self.buckets)
            if rows <= top and rows >= 2 * groups  # a group holds two rows at least
        ]
        for i, key in enumerate(keys):
            if key not in self._graphs:
                if self.use_graphs:
                    self._capture(*key)
                else:
                    self._body(*key)
            self.warm_keys.add(key)
            if progress is not None:
                progress(i + 1, len(keys))
        return len(self._graphs)
