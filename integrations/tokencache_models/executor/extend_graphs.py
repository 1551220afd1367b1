"""CUDA-graph multi-token forwards: catch-ups and short prefill chunks replayed from graphs.

An eager multi-token forward costs its host launches whatever its size (on an H200, 15-20 ms
for a Qwen3-8B catch-up of 1 x 10 or 10 x 10 tokens, about 0.5 ms of host time a layer). This
runner replays it from a CUDA graph instead, as the decode runner (decode_graphs.py) does for
decode.

Buckets: a graph per (rows, tokens, q_width), not per (rows x width). The GEMMs cost what the
tokens are (by an H200's specifications a bf16 forward turns compute-bound near 160 tokens, a
projection), so the token count is bucketed on its own (DEFAULT_EXTEND_TOKENS) rather than as
rows x width, which would pad 10 x 10 tokens to 16 x 16 = 256. q_width (DEFAULT_EXTEND_Q_WIDTHS:
at least the longest row's new tokens) sizes the attention kernel's grid: few, coarse values,
since a wider one only adds programs that end at once; rows come from row buckets. The keys
are few enough to capture them all up front (capture_all). A step is laid out as:

- its real rows first, their tokens, positions, out slots and slot-list ranges as they are;
- the padding tokens (tokens bucket - real tokens) after them, in padding rows of at most
  q_width tokens each: token 0 at position 0, writing only the pool's scratch slot, attending
  over entries [0, n) of the slot buffer (any slot ids: a padding row's output is dropped);
- empty rows (no token, one entry) up to the rows bucket.

So padding never writes a live slot, and real rows read exactly what they read eagerly. The
varlen metadata (q offsets, row starts and lengths, last tokens) is read from device buffers
filled in one copy per step; the Triton kernel's grid and its split-KV count come from the key
(rows, q_width: what an eager launch over that many rows chooses at a long context, rounded up
to a power of two; a short context leaves some splits empty), so no host synchronisation
happens inside. The torch backend builds one padded group on the device
(attention.TorchPagedAttention._static_tables) and keys its graphs by the gather width too.

Shapes outside the buckets (more tokens, rows or new tokens a row than the largest bucket, a
slot list over the buffer) run eagerly: no graph broken at attention, so they pay the eager
launch cost. Rows that share a prefix are graphed too, each reading its whole slot list: the
shared-prefix kernel, which reads such a prefix once, runs in eager multi-token forwards only
(more KV traffic than it, far less time than an eager forward's launches).
The epilogue (greedy tokens, entropy, the router's answer) is captured in the graph, as for
decode. Off CUDA the same static path runs without the capture (use_graphs=False): that is what
the tests compare with eager.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..forward.context import (
    KV_CHUNK,
    ForwardContext,
    ForwardOutput,
    HostBatch,
    decode_bucket,
    decode_kv_width,
)
from ..forward.epilogue import Epilogue
from .decode_graphs import DEFAULT_KV_CAPACITY, ForwardBody
from .static_buffers import GraphStep, StaticBufferRunner

if TYPE_CHECKING:
    from ..attention import TorchPagedAttention
    from ..kv.pool import KVPool
    from ..kv.slot_table import SlotTable

# Rows up to the engine's default admissions (max_running + max_parked = 64) with their padding
# rows; tokens up to its default chunked-prefill budget (2048): every forward of a default
# engine fits.
DEFAULT_EXTEND_ROWS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_EXTEND_TOKENS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)
DEFAULT_EXTEND_Q_WIDTHS: tuple[int, ...] = (16, 64, 512, 2048)

# (rows, tokens, q_width, gather width (torch) or 0, splits (Triton) or 0, slot source, epilogue)
ExtendKey = tuple[int, int, int, int, int, int, Epilogue | None]


# A multi-token forward loaded into a runner's static buffers, ready to replay.
ExtendStep = GraphStep[ExtendKey]


class ExtendGraphRunner(StaticBufferRunner[ExtendKey]):
    """Multi-token forwards of one (pool, attention backend) through static buffers, replayed
    from CUDA graphs captured per ExtendKey on first use (one memory pool for all of them)."""

    source_field = 5

    def __init__(
        self,
        model: ForwardBody,
        pool: KVPool,
        backend: TorchPagedAttention,
        rows: Sequence[int] = DEFAULT_EXTEND_ROWS,
        tokens: Sequence[int] = DEFAULT_EXTEND_TOKENS,
        kv_capacity: int | None = None,
        use_graphs: bool | None = None,
        q_widths: Sequence[int] = DEFAULT_EXTEND_Q_WIDTHS,
    ) -> None:
        if any(not b or min(b) < 1 for b in (rows, tokens, q_widths)):
            raise ValueError("extend buckets must be non-empty lists of positive sizes")
        self.row_buckets = tuple(sorted(set(rows)))
        self.token_buckets = tuple(sorted(set(tokens)))
        self.q_widths = tuple(sorted(set(q_widths)))
        self.max_rows, self.max_tokens = self.row_buckets[-1], self.token_buckets[-1]
        r, t = self.max_rows, self.max_tokens
        # The packed inputs: tokens, positions, out slots, q offsets, row starts, row lengths,
        # last tokens, the deferred tokens' source indices, destinations.
        layout = (t, t, t, r + 1, r, r, r, t, t)
        capacity = kv_capacity or DEFAULT_KV_CAPACITY
        super().__init__(model, pool, backend, layout, capacity, use_graphs)
        (
            self._tokens,
            self._positions,
            self._out_slots,
            self._q_offsets,
            self._kv_starts,
            self._kv_lens,
            self._last_token,
            self._deferred_index,
            self._deferred_dest,
        ) = self._split()
        self.triton = backend.name == "triton"
        self._split_counts: dict[tuple[int, int], int] = {}  # (rows, q_width) -> splits

    # -- the layout ----------------------------------------------------------------------

    def shape(self, hb: HostBatch) -> tuple[int, int, int] | None:
        """(rows, tokens, q_width) of hb's static layout, or None when it fits no bucket."""
        tokens = decode_bucket(len(hb.token_ids), self.token_buckets)
        q_width = decode_bucket(int(hb.q_lens.max()), self.q_widths)
        if tokens is None or q_width is None:
            return None
        pad = tokens - len(hb.token_ids)
        rows = decode_bucket(hb.num_requests + -(-pad // q_width), self.row_buckets)
        if rows is None:
            return None
        return rows, tokens, q_width

    def fits(self, hb: HostBatch) -> bool:
        """A multi-token batch within the buckets, over a slot table on the model's device or
        with a slot list that fits the runner's buffer."""
        if hb.is_decode or hb.num_real != hb.num_requests:
            return False
        shape = self.shape(hb)
        if shape is None:
            return False
        if hb.table is not None:
            # Padding rows read entries [0, q_width) of the table.
            return hb.table.device == self._tokens.device and shape[2] <= hb.table.flat_host.size
        return max(len(hb.kv_slots), shape[2]) <= self.kv_capacity

    def _splits(self, rows: int, q_width: int) -> int:
        """The Triton varlen kernel's split count for a key: what an eager launch over `rows`
        rows of q_width tokens chooses at a long context, rounded up to a power of two."""
        if not self.triton:
            return 0
        known = self._split_counts.get((rows, q_width))
        if known is not None:  # a function of the key: computed once per key
            return known
        from ..kernels.split_kv import kv_block
        from ..kernels.varlen_attention import varlen_grid

        cfg = self.model.shard_config
        block = kv_block(self.pool.dtype)
        splits = varlen_grid(
            rows,
            q_width,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            rows * (1 << 20),  # long enough that the context caps nothing
            block,
            block,
        )[3]
        splits = self._split_counts[rows, q_width] = 1 << (splits - 1).bit_length()
        return splits

    # -- a step --------------------------------------------------------------------------

    @torch.inference_mode()  # the buffers may be inference tensors (made in a forward)
    def prepare(self, hb: HostBatch, epilogue: Epilogue | None = None) -> ExtendStep:
        """The step's host work: its static layout in one copy into the buffers."""
        if not self.fits(hb):
            raise ValueError("multi-token batch does not fit the extend graph runner (see fits)")
        shape = self.shape(hb)
        assert shape is not None
        rows, tokens, q_width = shape
        n_rows, n_tokens = hb.num_requests, len(hb.token_ids)
        pad = tokens - n_tokens
        pad_lens = np.full(-(-pad // q_width), q_width, np.int64)
        if pad:
            pad_lens[-1] = pad - q_width * (len(pad_lens) - 1)
        empty = rows - n_rows - len(pad_lens)
        q_lens = np.concatenate((hb.q_lens, pad_lens, np.zeros(empty, np.int64)))
        q_offsets = np.concatenate(([0], np.cumsum(q_lens)))
        # Padding rows read entries [0, n) of the slot buffer (slot ids, never written);
        # empty rows one entry, so that no row of the torch path's mask is empty.
        kv_lens = np.concatenate((hb.kv_lens, pad_lens, np.ones(empty, np.int64)))
        source = self._slot_source(hb.table)
        width = decode_kv_width(int(kv_lens.max())) if self.width_keyed else 0
        splits = self._splits(rows, q_width)
        host = self._host_inputs()
        at, scratch = self._starts, self.pool.scratch_slot
        host[at[0] : at[0] + tokens] = 0  # padding tokens: token 0 at position 0, scratch
        host[at[0] : at[0] + n_tokens] = hb.token_ids
        host[at[1] : at[1] + tokens] = 0
        host[at[1] : at[1] + n_tokens] = hb.positions
        host[at[2] : at[2] + tokens] = scratch
        host[at[2] : at[2] + n_tokens] = hb.out_slots
        host[at[3] : at[3] + rows + 1] = q_offsets
        host[at[4] : at[4] + rows] = 0
        host[at[4] : at[4] + n_rows] = hb.kv_starts
        host[at[5] : at[5] + rows] = kv_lens
        host[at[6] : at[6] + rows] = q_offsets[1:] - 1
        deferred = hb.deferred
        if deferred is not None:
            deferred.check_device(self._tokens.device)
            m = len(deferred)
            host[at[7] : at[7] + m] = deferred.index
            host[at[8] : at[8] + m] = deferred.dest
        self._load_step(hb)
        return GraphStep(n_rows, (rows, tokens, q_width, width, splits, source, epilogue))

    def static_context(
        self, rows: int, tokens: int, q_width: int, width: int, splits: int, source: int
    ) -> ForwardContext:
        """A context whose tensors are views of the static buffers."""
        return self._buffer_context(
            rows,
            tokens,
            source,
            max_q_len=q_width,
            kv_width=width,
            is_decode=False,
            q_width=q_width,
            splits=splits or None,
        )

    def _forward(self, key: ExtendKey) -> ForwardOutput:
        epilogue = key[6]
        out = self.model.run(self.static_context(*key[:6]), self.pool, self.backend)
        return epilogue.apply(out) if epilogue is not None else out

    def shapes(
        self, max_rows: int | None = None, max_tokens: int | None = None
    ) -> list[tuple[int, int, int]]:
        """Every (rows, tokens, q_width) that a step of at most max_rows real rows and
        max_tokens tokens (default: all that fit) is laid out as, largest first."""
        r_cap = max_rows or self.max_rows
        t_cap = min(max_tokens or self.max_tokens, self.max_tokens)
        out = set()
        # shape() of every step: r real rows whose longest has a q_width's worth, t tokens in
        # all, then its padding rows; enumerated over t rather than derived, so that no
        # reachable key is missed (r + padding rows is an interval: every bucket it touches).
        for t in range(1, t_cap + 1):
            tokens = decode_bucket(t, self.token_buckets)
            assert tokens is not None
            for q_width in self.q_widths:
                below = [w for w in self.q_widths if w < q_width]
                longest = below[-1] + 1 if below else 1  # the least that needs this q_width
                lo, hi = -(-t // q_width), min(t - longest + 1, r_cap)
                if lo > hi:
                    continue
                pad_rows = -(-(tokens - t) // q_width)
                first = decode_bucket(lo + pad_rows, self.row_buckets)
                for rows in self.row_buckets:
                    if (
                        first is not None
                        and first <= rows
                        and (rows == first or self._below(rows) < hi + pad_rows)
                    ):
                        out.add((rows, tokens, q_width))
        return sorted(out, reverse=True)

    def _below(self, rows: int) -> int:
        """The row bucket below `rows` (0 for the first)."""
        smaller = [r for r in self.row_buckets if r < rows]
        return smaller[-1] if smaller else 0

    @torch.inference_mode()
    def capture_all(
        self,
        epilogue: Epilogue | None = None,
        table: SlotTable | None = None,
        max_rows: int | None = None,
        max_tokens: int | None = None,
        widths: Sequence[int] = (KV_CHUNK,),
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Captures the graph of every key (shapes(max_rows, max_tokens)), largest first so the
        smaller ones reuse its pool memory, over the slot table the steps will read (None: the
        runner's own buffer) with the epilogue they will ask for; torch-path graphs once per
        given gather width. Each runs on padding alone (rows read entries [0, n) of the buffer
        and write only the scratch slot). Off CUDA (use_graphs False) each key's static path
        runs once instead. Either way the keys count as warm from now on (cold_runs counts
        the steps that come outside them). progress(done, total) after each. Returns the
        number of graphs held."""
        source = self._slot_source(table)
        shapes = self.shapes(max_rows, max_tokens)
        keys = [
            (rows, tokens, q_width, w, self._splits(rows, q_width), source, epilogue)
            for w in (widths if self.width_keyed else (0,))
            for rows, tokens, q_width in shapes
        ]
        return self._warm(keys, progress, lambda key: self._load_padding(*key[:3]))

    def _load_padding(self, rows: int, tokens: int, q_width: int) -> None:
        """The buffers as a step of padding rows alone (q_width tokens each, as many rows as
        the tokens fill, empty rows after)."""
        full, rest = divmod(tokens, q_width)
        lens = [q_width] * full + ([rest] if rest else [])
        q_lens = np.array(lens + [0] * (rows - len(lens)), np.int64)
        q_offsets = np.concatenate(([0], np.cumsum(q_lens)))
        host, at = self._host_inputs(), self._starts
        host[at[0] : at[0] + tokens] = 0
        host[at[1] : at[1] + tokens] = 0
        host[at[2] : at[2] + tokens] = self.pool.scratch_slot
        host[at[3] : at[3] + rows + 1] = q_offsets
        host[at[4] : at[4] + rows] = 0
        host[at[5] : at[5] + rows] = np.maximum(q_lens, 1)
        host[at[6] : at[6] + rows] = q_offsets[1:] - 1
        self._copy_in()
