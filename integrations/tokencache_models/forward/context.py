"""The per-forward context: what every layer needs to know about one batch, built once.

Like nano-vllm's utils/context.py, but passed explicitly instead of living in a global. Every
host-side fact (lengths, maxima, the decode flag, padding) is computed here from the CPU inputs
before the first kernel runs; the index tensors then travel to the device in ONE copy (from pinned
memory, asynchronously, on CUDA). Nothing between the first and the last kernel of a forward
needs to read device memory back on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..arrays import has_duplicates
from ..shared_prefix.groups import PrefixGroup, groups_over_rows, paying_groups, prefix_tables
from ..shared_prefix.shape import MIN_SHARED_PREFIX, PrefixShape
from .forward_batch import ForwardBatch

if TYPE_CHECKING:
    from ..kv.slot_table import SlotTable

# Batch sizes a padded decode batch is rounded up to (and the CUDA graphs captured for them).
DEFAULT_DECODE_BUCKETS: tuple[int, ...] = (
    *(1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128),
    *(160, 192, 224, 256),
)
# KV chunk of the torch decode path: gathers are padded to KV_CHUNK * 2**k columns.
KV_CHUNK = 64


def shared_prefix_len(
    kv_slots: np.ndarray,
    kv_offsets: np.ndarray,
    q_offsets: np.ndarray,
    num_real: int | None = None,
    min_len: int = MIN_SHARED_PREFIX,
) -> int:
    """P: how many leading slot-list entries every real row (the first num_real, default all)
    has in common, capped so each row's new tokens come after them (P <= kv_len - q_len); 0
    when that is under min_len or fewer than two rows are real. Shared-prefix attention reads
    those P slots once for the whole batch instead of once per row. Host numpy, O(rows x P)
    compares (~0.1 ms at 32 rows x 8k on a slow core); a pure function of the slot lists, so a
    caller's claim never has to be trusted."""
    n = len(kv_offsets) - 1 if num_real is None else num_real
    if n < 2:
        return 0
    starts = kv_offsets[:n]
    # At most min(kv_len - q_len): every row's new tokens come after the prefix.
    p = int((np.diff(kv_offsets[: n + 1]) - np.diff(q_offsets[: n + 1])).min())
    first = kv_slots[starts[0] : starts[0] + p]
    for s in starts[1:].tolist():
        if p < min_len:
            return 0
        row = kv_slots[s : s + p]
        if not np.array_equal(row, first[:p]):
            p = int(np.argmax(row != first[:p]))
    return p if p >= min_len else 0


def decode_bucket(batch: int, buckets: Sequence[int]) -> int | None:
    """Smallest bucket >= batch, or None when batch is larger than every bucket."""
    for b in buckets:
        if b >= batch:
            return b
    return None


def decode_kv_width(max_kv_len: int) -> int:
    """KV_CHUNK * 2**k >= max_kv_len: the padded gather width of the torch decode path."""
    chunks = max(1, -(-max_kv_len // KV_CHUNK))
    return KV_CHUNK * (1 << (chunks - 1).bit_length())


@dataclass(frozen=True)
class DeferredTokens:
    """Input tokens the host does not know yet: rows of a device tensor (the previous step's
    sampled tokens) that replace placeholders in the forward's flat token_ids.

    An overlapped scheduler prepares step n+1 while the device still runs step n, so each
    continuing request's input token is step n's sampled token, which lives on the device only.
    The forward resolves token_ids[dest] = source[index] on the device, after its one packed
    host -> device copy (index and dest travel in it), so the host never waits for step n: the
    placeholders in the host token_ids are ignored. Shapes are checked here and against the
    batch (HostBatch), early, on the host; the values of `source` are never read on the host.
    `source` must be ready on the current stream (made on it, or waited for by the caller)."""

    source: torch.Tensor  # [K] int64 on the model's device
    index: np.ndarray  # [m] int64: which source entries
    dest: np.ndarray  # [m] int64: which flat token positions they fill
    # index == dest == arange(K): the first K tokens are the source as it is (steady overlapped
    # decoding: every row goes on in its place), one plain copy on the device, no index.
    in_place: bool = False

    def __post_init__(self) -> None:
        index = np.asarray(self.index, np.int64).reshape(-1)
        dest = np.asarray(self.dest, np.int64).reshape(-1)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "dest", dest)
        if self.source.dim() != 1 or self.source.dtype != torch.int64:
            raise ValueError(
                f"DeferredTokens.source must be a 1-d int64 tensor, got {self.source.dtype} "
                f"of shape {tuple(self.source.shape)}"
            )
        if len(index) != len(dest):
            raise ValueError(
                f"DeferredTokens: {len(index)} source indices for {len(dest)} destinations"
            )
        k = self.source.shape[0]  # a host-known shape: reading it is no sync
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= k):
            raise ValueError(f"DeferredTokens.index out of range for a source of {k} tokens")
        if len(dest) and int(dest.min()) < 0:
            raise ValueError("DeferredTokens.dest holds a negative token position")
        if has_duplicates(dest):
            raise ValueError("DeferredTokens.dest fills a token position twice")
        if self.in_place:
            ident = np.arange(k)
            if not (np.array_equal(index, ident) and np.array_equal(dest, ident)):
                raise ValueError("DeferredTokens.in_place needs index == dest == arange(K)")

    @classmethod
    def of_rows(
        cls, source: torch.Tensor, index: np.ndarray, dest: np.ndarray, in_place: bool = False
    ) -> DeferredTokens:
        """Without the checks, for a caller whose arrays are valid by construction (int64,
        index rows of source, dest distinct and >= 0; in_place only where index == dest ==
        arange(len(source))): an overlapped scheduler builds one each step from its own plan
        (tokencache_routing's prepare_forward). check() and check_device() still run where
        the batch is loaded."""
        out = cls.__new__(cls)
        object.__setattr__(out, "source", source)
        object.__setattr__(out, "index", index)
        object.__setattr__(out, "dest", dest)
        object.__setattr__(out, "in_place", in_place)
        return out

    def __len__(self) -> int:
        return len(self.dest)

    def check(self, num_tokens: int) -> None:
        """Every destination is one of the batch's num_tokens flat positions."""
        if len(self.dest) and int(self.dest.max()) >= num_tokens:
            raise ValueError(
                f"DeferredTokens.dest {int(self.dest.max())} out of range for a batch of "
                f"{num_tokens} tokens"
            )

    def check_device(self, device: torch.device) -> None:
        if self.source.device != device:
            raise ValueError(
                f"DeferredTokens.source is on {self.source.device}, the model on {device}"
            )

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        """source[index] on the device (index: this step's moved copy of self.index)."""
        return self.source.index_select(0, index)


@dataclass
class HostBatch:
    """The batch as numpy int64 arrays, possibly with padding rows appended (decode only).

    Row i attends over kv_slots[kv_starts[i] : kv_starts[i] + kv_lens[i]], which ends with its
    new tokens' out_slots. kv_slots is either a slot list concatenated for this forward
    (ForwardBatch) or the flat host view of the engine's slot table (`table`, rows `rows`),
    whose rows already hold every request's slots: then nothing here is O(context), the table
    itself is what the kernels read on the device, and shared-prefix candidates come from the
    facts the table keeps per row (SlotTable.prefix_groups) instead of a search of slot lists.
    """

    token_ids: np.ndarray
    positions: np.ndarray
    out_slots: np.ndarray
    q_offsets: np.ndarray
    kv_slots: np.ndarray
    kv_starts: np.ndarray
    kv_lens: np.ndarray
    num_real: int  # requests [0, num_real) are real; the rest are padding rows
    table: SlotTable | None = None
    rows: np.ndarray | None = None  # the real rows' slot-table rows (with `table`)
    # Input tokens still on the device (the previous step's samples): token_ids[dest] are
    # placeholders, replaced on the device by every forward path (DeferredTokens).
    deferred: DeferredTokens | None = None
    # Candidate groups once found (the runner and the GPU clock both ask); shared by the
    # padded copies, whose real rows are the same.
    memo: dict[str, list[PrefixGroup]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.deferred is not None:
            self.deferred.check(len(self.token_ids))

    @classmethod
    def from_batch(
        cls, batch: ForwardBatch, *, deferred: DeferredTokens | None = None
    ) -> HostBatch:
        def np64(t: torch.Tensor) -> np.ndarray:
            return np.asarray(t.detach().cpu().numpy(), dtype=np.int64).reshape(-1)

        kv_offsets = np64(batch.kv_offsets)
        return cls(
            token_ids=np64(batch.token_ids),
            positions=np64(batch.positions),
            out_slots=np64(batch.out_slots),
            q_offsets=np64(batch.q_offsets),
            kv_slots=np64(batch.kv_slots),
            kv_starts=kv_offsets[:-1],
            kv_lens=np.diff(kv_offsets),
            num_real=batch.num_requests,
            deferred=deferred,
        )

    @classmethod
    def from_table(
        cls,
        table: SlotTable,
        rows: np.ndarray,
        token_ids: np.ndarray,
        positions: np.ndarray,
        out_slots: np.ndarray,
        q_offsets: np.ndarray,
        kv_lens: np.ndarray,
        *,
        deferred: DeferredTokens | None = None,
        kv_starts: np.ndarray | None = None,
    ) -> HostBatch:
        """A forward over slot-table rows whose entries [0, kv_lens[i]) already hold each
        request's slots, this forward's new ones included (SlotTable.scatter). deferred: input
        tokens still on the device (their token_ids entries are placeholders). kv_starts:
        table.starts(rows), when the caller kept them (the same rows, the storage unmoved)."""
        return cls(
            token_ids=token_ids,
            positions=positions,
            out_slots=out_slots,
            q_offsets=q_offsets,
            kv_slots=table.flat_host,
            kv_starts=table.starts(rows) if kv_starts is None else kv_starts,
            kv_lens=kv_lens,
            num_real=len(rows),
            table=table,
            rows=rows,
            deferred=deferred,
        )

    @property
    def num_requests(self) -> int:
        return len(self.q_offsets) - 1

    @property
    def q_lens(self) -> np.ndarray:
        return np.diff(self.q_offsets)

    @property
    def is_decode(self) -> bool:
        return int(self.q_offsets[-1]) == self.num_requests

    def shared_prefix_len(self, min_len: int = MIN_SHARED_PREFIX) -> int:
        """The real rows' common slot-list prefix (see shared_prefix_len); padding excluded."""
        n = self.num_real
        offsets = np.concatenate(([0], np.cumsum(self.kv_lens[:n])))
        starts, lens = self.kv_starts[:n].tolist(), self.kv_lens[:n].tolist()
        rows = [self.kv_slots[s : s + k] for s, k in zip(starts, lens, strict=True)]
        flat = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        return shared_prefix_len(flat, offsets, self.q_offsets, n, min_len)

    def prefix_groups(self, shape: PrefixShape) -> list[PrefixGroup]:
        """The groups of real rows whose common slot-list prefix the shared-prefix kernel of
        `shape` reads once, where that pays (shared_prefix.groups.paying_groups); padding rows
        excluded. From the table's kept facts when there is one, else a search of the slot lists."""
        return paying_groups(self.candidate_groups(), self.q_offsets, shape, self.is_decode)

    def candidate_groups(self) -> list[PrefixGroup]:
        """The real rows' shared-prefix groups before paying_groups' verdict."""
        found = self.memo.get("groups")
        if found is None:
            n = self.num_real
            # decode: one new token a row (no q_lens to derive)
            caps = self.kv_lens[:n] - (1 if self.is_decode else self.q_lens[:n])
            if self.table is not None and self.rows is not None:
                found = self.table.prefix_groups(self.rows[:n], caps)
            else:
                found = groups_over_rows(self.kv_slots, self.kv_starts[:n], caps)
            self.memo["groups"] = found
        return found

    def padded(self, rows: int, scratch_slot: int) -> HostBatch:
        """Appends decode padding rows up to `rows`: token 0 at position 0, writing and reading
        only the scratch slot (a one-token context), so real rows are untouched. Deferred
        tokens are kept (the real tokens keep their flat positions)."""
        n = rows - self.num_requests
        if n < 0:
            raise ValueError(f"cannot pad {self.num_requests} requests down to {rows} rows")
        if n == 0:
            return self
        zeros, scratch = np.zeros(n, np.int64), np.full(n, scratch_slot, np.int64)
        ones = np.arange(1, n + 1, dtype=np.int64)
        kv_slots = self.kv_slots
        if self.table is not None:
            scratch_start = self.table.scratch_start  # the table's scratch row
        else:
            scratch_start = len(kv_slots)
            kv_slots = np.concatenate((kv_slots, [scratch_slot]))
        return dataclasses.replace(
            self,
            token_ids=np.concatenate((self.token_ids, zeros)),
            positions=np.concatenate((self.positions, zeros)),
            out_slots=np.concatenate((self.out_slots, scratch)),
            q_offsets=np.concatenate((self.q_offsets, self.q_offsets[-1] + ones)),
            kv_slots=kv_slots,
            kv_starts=np.concatenate((self.kv_starts, np.full(n, scratch_start, np.int64))),
            kv_lens=np.concatenate((self.kv_lens, np.ones(n, np.int64))),
        )


def to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 host arrays -> device tensors in one copy (pinned and non-blocking on CUDA); on
    the CPU the arrays themselves, viewed as tensors (no copy)."""
    if device.type == "cpu":
        return [torch.from_numpy(np.ascontiguousarray(a, np.int64).reshape(-1)) for a in arrays]
    sizes = [int(a.size) for a in arrays]
    total = sum(sizes)
    if device.type == "cuda":
        host = torch.empty(total, dtype=torch.int64, pin_memory=True)
    else:
        host = torch.empty(total, dtype=torch.int64)
    if total:
        np.concatenate([a.reshape(-1) for a in arrays], out=host.numpy())
    flat = host.to(device, non_blocking=True) if device.type != "cpu" else host
    return list(torch.split(flat, sizes))


@dataclass(frozen=True)
class SharedPrefix:
    """A forward's shared-prefix tables on the device (shared_prefix.groups.PrefixTables) and what
    the host knows of them. Inside a CUDA graph the tables are static buffers refilled every step;
    then the host facts are None (the graph serves any grouping)."""

    row_skip: torch.Tensor  # [rows] the prefix each row's own kernels skip
    tiles: torch.Tensor  # [num_tiles * TILE_FIELDS]
    tokens: torch.Tensor  # [T] query tokens grouped by tile
    # Query tokens per tile the host cut the table for (PrefixShape.tokens_per_block): the
    # kernel, whose tile comes from the tensors' shapes, checks that it holds that many.
    tokens_per_tile: int
    groups: tuple[PrefixGroup, ...] | None = None
    skipped: int | None = None  # sum of rows x P over the groups: slot reads the rows skip
    longest: int | None = None  # the longest group prefix


@dataclass(frozen=True)
class HostPlan:
    """An attention backend's host plan of one forward (backend.plan): the facts it derived on
    the host and the int64 arrays that travel with the batch in the context's one copy."""

    # The torch path's padded groups of a multi-token batch: (rows, Qmax, Lmax) each.
    groups: tuple[tuple[int, int, int], ...] = ()
    arrays: tuple[np.ndarray, ...] = ()


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, vocab] next-token logits after each request's last new token
    hidden: torch.Tensor  # [B, hidden] final-norm output of each request's last new token
    # Set by an Epilogue (epilogue.py) when the forward was asked for one: each row's argmax
    # over the epilogue's vocabulary ([B] int64), its entropy ([B] float32) and an entropy
    # router's answer ([B] bool), on the device.
    greedy: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    escalate: torch.Tensor | None = None

    def each(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ForwardOutput:
        """fn applied to every tensor of the output (the epilogue's too, when there)."""
        return ForwardOutput(
            logits=fn(self.logits),
            hidden=fn(self.hidden),
            greedy=fn(self.greedy) if self.greedy is not None else None,
            entropy=fn(self.entropy) if self.entropy is not None else None,
            escalate=fn(self.escalate) if self.escalate is not None else None,
        )

    def rows(self, idx: torch.Tensor) -> ForwardOutput:
        """The output of rows idx (an index tensor), epilogue values included."""
        return self.each(lambda t: t[idx.to(t.device)])


@dataclass(frozen=True)
class ForwardContext:
    """One forward's batch layout on the model device plus the host facts derived from it.

    Rows [0, num_real) are the caller's requests; rows beyond are padding (decode buckets).
    Built once (build, or a graph runner's static buffers) and never changed: what a forward
    derives from it on the device (the backend's tables, RoPE) is a separate frozen object
    made before the first layer (model.LayerContext).
    """

    num_requests: int  # rows, padding included
    num_real: int
    num_tokens: int
    max_q_len: int
    kv_width: int  # >= every row's kv length: the width of padded KV gathers
    is_decode: bool  # every row has exactly one new token
    token_ids: torch.Tensor  # [T] int64 (all index tensors live on the model device)
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T]
    # Row i attends over kv_slots[kv_starts[i] : kv_starts[i] + kv_lens[i]]: a slot list made
    # for this forward, or the flat slot table (its rows hold every request's slots).
    kv_slots: torch.Tensor  # [S]
    q_offsets: torch.Tensor  # [B + 1]
    kv_starts: torch.Tensor  # [B]
    kv_lens: torch.Tensor  # [B]
    last_token: torch.Tensor  # [B] index of each row's last new token in [0, T)
    scratch_slot: int  # pool row that padding tokens write (see KVPool.scratch_slot)
    kv_total: int = 0  # sum of kv_lens: the slots the rows read (a host fact for grids)
    # Shared-prefix attention (None: off): groups of rows whose common slot-list prefix is
    # read once per tile instead of once per row.
    prefix: SharedPrefix | None = None
    # The attention backend's host plan (HostPlan.groups) and its arrays, moved in the one copy.
    plan_groups: tuple[tuple[int, int, int], ...] = ()
    plan_arrays: tuple[torch.Tensor, ...] = ()
    # A multi-token batch in a graph's static layout (executor.extend_graphs.ExtendGraphRunner):
    # every row has at most q_width new tokens, and the attention backends size everything from the
    # context's shapes and these numbers, never from host facts about the rows (0: not static).
    q_width: int = 0
    # The Triton varlen kernel's split-KV count, fixed by the graph's key (None: chosen from
    # the host facts, eagerly).
    splits: int | None = None

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    @classmethod
    def build(
        cls,
        batch: ForwardBatch | HostBatch,
        device: torch.device,
        scratch_slot: int,
        plan: Callable[[HostBatch], HostPlan] | None = None,
        pad_rows_to: int | None = None,
        shared_prefix: PrefixShape | None = None,
    ) -> ForwardContext:
        """Host work first (lengths, maxima, padding, the backend's host plan), then one copy.

        plan(host_batch) -> HostPlan lets the attention backend precompute its host-side
        tables; its arrays land in ctx.plan_arrays in the same order. shared_prefix: the
        attention shape of a backend that reads shared slot-list prefixes once
        (HostBatch.prefix_groups); None: it does not.
        """
        hb = batch if isinstance(batch, HostBatch) else HostBatch.from_batch(batch)
        if pad_rows_to is not None:
            hb = hb.padded(pad_rows_to, scratch_slot)
        q_lens, kv_lens = hb.q_lens, hb.kv_lens
        is_decode = hb.is_decode
        max_kv = int(kv_lens.max())
        host_plan = plan(hb) if plan is not None else HostPlan()
        extra = list(host_plan.arrays)
        base = [
            hb.token_ids,
            hb.positions,
            hb.out_slots,
            hb.q_offsets,
            hb.kv_starts,
            kv_lens,
            hb.q_offsets[1:] - 1,
        ]
        writes = hb.table.take_writes() if hb.table is not None else None
        if hb.table is None:
            base.append(hb.kv_slots)  # a slot list made for this forward travels with it
        elif writes is not None:
            base += writes  # the table's new entries, applied on the device below
        groups = hb.prefix_groups(shared_prefix) if shared_prefix is not None else []
        tables = []
        if groups:
            assert shared_prefix is not None
            tables = prefix_tables(groups, hb.q_offsets, hb.kv_starts, shared_prefix).arrays()
        deferred = hb.deferred
        late: list[np.ndarray] = []
        if deferred is not None:
            deferred.check_device(device)
            late = [deferred.index, deferred.dest]  # in the same one copy
        moved = to_device(base + tables + extra + late, device)
        at = len(base) + len(tables)
        token_ids = moved[0]
        if deferred is not None:
            # token_ids[dest] = source[index], on the device and out of place (on the CPU
            # moved[0] is a view of the caller's array): no host sync, placeholders ignored.
            index, dest = moved[-2], moved[-1]
            token_ids = token_ids.index_copy(0, dest, deferred.gather(index))
        if hb.table is None:
            kv_slots = moved[7]
        else:
            kv_slots = hb.table.flat
            if writes is not None:
                kv_slots.index_copy_(0, moved[7], moved[8])
        prefix = None
        if groups:
            assert shared_prefix is not None
            row_skip, tiles, tokens = moved[len(base) : len(base) + len(tables)]
            prefix = SharedPrefix(
                row_skip,
                tiles,
                tokens,
                shared_prefix.tokens_per_block,
                groups=tuple(groups),
                skipped=sum(len(g.rows) * g.length for g in groups),
                longest=max(g.length for g in groups),
            )
        return cls(
            num_requests=hb.num_requests,
            num_real=hb.num_real,
            num_tokens=len(hb.token_ids),
            max_q_len=int(q_lens.max()),
            kv_width=decode_kv_width(max_kv) if is_decode else max_kv,
            is_decode=is_decode,
            token_ids=token_ids,
            positions=moved[1],
            out_slots=moved[2],
            kv_slots=kv_slots,
            q_offsets=moved[3],
            kv_starts=moved[4],
            kv_lens=moved[5],
            last_token=moved[6],
            scratch_slot=scratch_slot,
            kv_total=int(kv_lens.sum()),
            prefix=prefix,
            plan_groups=host_plan.groups,
            plan_arrays=tuple(moved[at : at + len(extra)]),
        )
