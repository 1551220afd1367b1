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

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from ..forward.context import (
    KV_CHUNK,
    ForwardContext,
    ForwardOutput,
    HostBatch,
    SharedPrefix,
    decode_bucket,
    decode_kv_width,
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
from .static_buffers import GraphStep, StaticBufferRunner

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


# A decode step loaded into a runner's static buffers, ready to replay.
StaticStep = GraphStep[GraphKey]


class DecodeGraphRunner(StaticBufferRunner[GraphKey]):
    """Decode steps of one (pool, attention backend) through static buffers, replayed from
    CUDA graphs captured per GraphKey."""

    source_field = 3

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
        # This rank's shapes (a tensor-parallel shard holds its own heads).
        self.prefix_shape = PrefixShape.of(model.shard_config, pool.dtype.itemsize)
        self.buckets = tuple(sorted(set(buckets)))
        self.max_rows = n = self.buckets[-1]
        # The packed inputs: tokens, positions, out slots, row starts and lengths, the
        # shared-prefix tables (shared-prefix graphs; shared_prefix.groups.PrefixTables): row
        # skips, tiles, tokens, and the deferred tokens' source indices and destinations
        # (DeferredTokens; at most a row each).
        tiles = max_tiles(self.prefix_shape, n) * TILE_FIELDS
        layout = (n, n, n, n, n, n, tiles, n, n, n)
        capacity = kv_capacity or max(DEFAULT_KV_CAPACITY, n)
        super().__init__(model, pool, backend, layout, capacity, use_graphs)
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
        ) = self._split()
        # Decode: one token per row, always.
        self._q_offsets = torch.arange(n + 1).to(device=model.device, dtype=torch.int64)
        self._last_token = torch.arange(n).to(device=model.device, dtype=torch.int64)
        # The last step's prefix tables and what they were built from: steady decoding keeps
        # its groups, rows and offsets from step to step, so the tables repeat.
        self._tables_key: tuple[Any, ...] | None = None
        self._tables: PrefixTables | None = None
        self._reset()

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
        return self._buffer_context(
            rows, rows, source, max_q_len=1, kv_width=kv_width, is_decode=True, prefix=prefix
        )

    def _load(self, hb: HostBatch, tables: PrefixTables | None) -> None:
        """The padded step into the static buffers: its inputs in one copy of the packed buffer
        (written in place on the CPU), the slot table's queued writes (or a step's own slot
        list) apart. Rows past the bucket and slot-list entries past its end are never read."""
        rows, host, at = hb.num_requests, self._host_inputs(), self._starts
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
        self._load_step(hb)

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
        return GraphStep(b, self._key(rows, width, n, source, epilogue))

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

    def _forward(self, key: GraphKey) -> ForwardOutput:
        rows, width, groups, source, epilogue = key  # the prefix tables are in their buffers
        out = self.model.run(
            self.static_context(rows, width, groups, source), self.pool, self.backend
        )
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
        return self._warm(keys, progress)
