"""Test harness: a recording allocator, simulated requests and one driver per cache.

Imported inside tests, after conftest has stubbed torchvision.

The same op stream drives SGLang's own RadixCache and TokenCacheRadixCache through identical
code; every op returns what a scheduler could observe, so the two sides can be compared.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from sglang.srt.managers.schedule_batch import ReqKvInfo
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.radix_cache import RadixKey

MAX_ROWS = 64
MAX_LEN = 1024

# (extra_key, cache_salt) pairs; index 0 is the default namespace.
NAMESPACES: tuple[tuple[str | None, str | None], ...] = (
    (None, None),
    ("lora-a", None),
    ("lora-a", "salt"),
)


class RecordingAllocator:
    """Stands in for SGLang's token allocator: records every slot handed back."""

    def __init__(self, page_size: int) -> None:
        self.device = torch.device("cpu")
        self.page_size = page_size
        self._freed: list[np.ndarray] = []

    def free(self, free_index: torch.Tensor) -> None:
        self._freed.append(free_index.detach().cpu().numpy().astype(np.int64))

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        assert start_pos % self.page_size == 0, f"unaligned segment start {start_pos}"
        self.free(free_index)

    def free_segments(self, segments: list[tuple[torch.Tensor, int]]) -> None:
        for free_index, start_pos in segments:
            self.free_segment(free_index, start_pos=start_pos)

    free_full_segments = free_segments

    def take(self) -> list[int]:
        """Slots freed since the last call, sorted (frees are compared as multisets)."""
        freed = np.concatenate(self._freed) if self._freed else np.empty(0, dtype=np.int64)
        self._freed = []
        return sorted(freed.tolist())


class RowPool:
    """The req_to_token table checkpoint() reads and rewrites (int32, like SGLang's)."""

    def __init__(self) -> None:
        self.req_to_token = torch.zeros((MAX_ROWS, MAX_LEN), dtype=torch.int32)

    def write(self, indices: Any, values: torch.Tensor) -> None:
        self.req_to_token[indices] = values


class SlotSource:
    """Hands out fresh page-aligned slot runs; shared by both sides so slots agree."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.next_page = 1

    def pages(self, num_pages: int) -> np.ndarray:
        first = self.next_page
        self.next_page += num_pages
        return np.arange(first * self.page_size, (first + num_pages) * self.page_size)


@dataclass
class SimReq:
    """The Req fields RadixCache.checkpoint reads."""

    rid: str
    seq: np.ndarray
    origin_input_ids: array
    extra_key: str | None
    cache_salt: str | None
    row: int
    kv: ReqKvInfo = field(default_factory=ReqKvInfo)
    full_untruncated_fill_ids: array = field(default_factory=lambda: array("q"))
    priority: int | None = None
    lock: Any = None
    last_node: Any = None
    committed: int = 0


class Side:
    """One cache plus its allocator, row table and live requests/locks."""

    def __init__(self, cache: Any, allocator: RecordingAllocator, rows: RowPool) -> None:
        self.cache = cache
        self.alloc = allocator
        self.rows = rows
        self.page_size = cache.page_size
        self.reqs: dict[str, SimReq] = {}
        self.locks: list[Any] = []

    # ----- observations -----

    def sizes(self) -> tuple[int, int, int]:
        c = self.cache
        return (c.evictable_size(), c.protected_size(), c.total_size())

    def path(self, node: Any) -> list[int]:
        return self.cache.path_device_indices(node).tolist()

    def all_values(self) -> list[int]:
        if self.cache.total_size() == 0:
            return []  # RadixCache's torch.cat fails on an empty tree
        return sorted(self.cache.all_values_flatten().tolist())

    # ----- plain tree ops -----

    @staticmethod
    def key(tokens: np.ndarray, ns: int, limit: int | None = None) -> RadixKey:
        extra_key, cache_salt = NAMESPACES[ns]
        return RadixKey(array("q", tokens.tolist()), extra_key, limit=limit, cache_salt=cache_salt)

    def insert(self, tokens: np.ndarray, slots: np.ndarray, ns: int) -> int:
        value = torch.from_numpy(slots.astype(np.int64))
        return self.cache.insert(InsertParams(key=self.key(tokens, ns), value=value)).prefix_len

    def match(self, tokens: np.ndarray, ns: int) -> tuple[int, list[int], Any]:
        result = self.cache.match_prefix(MatchPrefixParams(key=self.key(tokens, ns)))
        node = result.last_device_node
        return result.device_prefix_len, self.path(node), node

    def lock_match(self, tokens: np.ndarray, ns: int) -> tuple[int, int]:
        length, _, node = self.match(tokens, ns)
        delta = self.cache.inc_lock_ref(node).delta
        self.locks.append(node)
        return length, delta

    def unlock(self, k: int) -> int:
        node = self.locks.pop(k % len(self.locks))
        return self.cache.dec_lock_ref(node).delta

    def evict(self, num_tokens: int) -> int:
        return self.cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted

    def dfs_order(self) -> list[int]:
        """The dfs-weight schedule order of every live request's and lock's node."""
        nodes = [self.reqs[rid].last_node for rid in sorted(self.reqs)] + list(self.locks)
        return self.cache.dfs_weight_order(nodes)

    # ----- request lifecycle (what the scheduler and mem_cache/common.py do) -----

    def start(self, rid: str, seq: np.ndarray, prompt_len: int, ns: int, row: int) -> tuple:
        extra_key, cache_salt = NAMESPACES[ns]
        origin = array("q", seq[:prompt_len].tolist())
        req = SimReq(rid, seq, origin, extra_key, cache_salt, row)
        # init_next_round_input: match at most input_len - 1 tokens.
        key = RadixKey(origin, extra_key, limit=prompt_len - 1, cache_salt=cache_salt)
        result = self.cache.match_prefix(MatchPrefixParams(key=key))
        req.last_node = result.last_device_node
        prefix = result.device_prefix_len
        req.kv.req_pool_idx = row
        req.kv.cache_protected_len = prefix
        req.lock = self.cache.lock(req.last_node)
        prefix_slots = self.cache.path_device_indices(req.last_node)[:prefix]
        self.rows.req_to_token[row, :prefix] = prefix_slots.to(torch.int32)
        req.committed = prefix
        req.full_untruncated_fill_ids = array("q", seq[:prefix].tolist())
        self.reqs[rid] = req
        return prefix, prefix_slots.tolist()

    def write_new_slots(self, req: SimReq, end: int, source: SlotSource) -> None:
        """Give positions [committed, end) slots: continue the row's open page, else new pages."""
        row = self.rows.req_to_token[req.row]
        ps = self.page_size
        pos = req.committed
        while pos < end:
            if pos % ps:
                row[pos] = row[pos - 1] + 1
                pos += 1
                continue
            n = min(ps, end - pos)
            row[pos : pos + n] = torch.from_numpy(source.pages(1)[:n].astype(np.int32))
            pos += n

    def extend(self, rid: str, end: int, source: SlotSource | None) -> tuple:
        """Run a forward to `end` (chunk or decode steps), then checkpoint it."""
        req = self.reqs[rid]
        if source is not None:
            self.write_new_slots(req, end, source)
        req.committed = end
        req.full_untruncated_fill_ids = array("q", req.seq[:end].tolist())
        self.cache.checkpoint(req, up_to=end)
        return self._req_view(req)

    def release(self, rid: str, *, checkpoint: bool) -> tuple:
        """release_kv_cache: optional checkpoint, free the request's own slots, unlock."""
        req = self.reqs.pop(rid)
        if checkpoint and req.committed > 0:
            self.cache.checkpoint(req, up_to=req.committed)
        view = self._req_view(req)
        start = req.kv.cache_protected_len
        if req.committed > start:
            own = self.rows.req_to_token[req.row, start : req.committed]
            self.alloc.free_segment(own, start_pos=start)
        self.cache.unlock(req.lock)
        req.lock = None
        return view

    def _req_view(self, req: SimReq) -> tuple:
        row = self.rows.req_to_token[req.row, : req.committed].tolist()
        return (
            req.kv.cache_protected_len,
            req.kv.cache_inserted_len,
            row,
            self.path(req.last_node),
        )


def make_side(cache_factory: Any, page_size: int) -> Side:
    allocator = RecordingAllocator(page_size)
    rows = RowPool()
    cache = cache_factory(allocator)
    cache.req_to_token_pool = rows
    return Side(cache, allocator, rows)


def corpus(seed: int, page_size: int, count: int = 12) -> list[np.ndarray]:
    """Token sequences that share prefixes: concatenations of a few reusable chunks whose
    lengths are not page multiples, so shared parts start and end mid-page."""
    rng = np.random.default_rng(seed)
    scale = max(1, page_size // 4)
    chunks = [rng.integers(1, 50, size=int(rng.integers(2, 12)) * scale) for _ in range(8)]
    seqs = []
    for _ in range(count):
        picks = rng.choice(len(chunks), size=int(rng.integers(2, 7)), p=_bias(len(chunks)))
        seqs.append(np.concatenate([chunks[i] for i in picks]).astype(np.int64))
    return seqs


def _bias(n: int) -> np.ndarray:
    # Early chunks are common, so many sequences share their first chunks.
    w = 1.0 / np.arange(1, n + 1)
    return w / w.sum()


def reference_leaf_priorities_distinct(ref: Any) -> bool:
    """No two evictable leaves of a RadixCache have the same eviction priority, so the
    order in which whole leaves go is fully determined."""
    prios = [ref.eviction_strategy.get_priority(n) for n in ref.evictable_leaves]
    return len(set(prios)) == len(prios)
