"""The request-to-slot table: one row per admitted request, holding its tokens' KV slot ids.

SGLang's req_to_token_pool is the anchor. A request's row is written once at admission (the
slots its prefix match found) and then appended with each forward's new slots only, so a step's
host work is O(batch + new tokens) whatever the context length: the kernels read a request's
KV through (row, length), never through a slot list rebuilt per step.

The table lives where the kernels read it. On the CPU that is one tensor, shared with the
numpy `host` view the engine writes. On CUDA the host view is a mirror and every write is also
queued (flat index, slot) and applied on the device by the next forward in one copy and one
index_copy_ (`take_writes`), before any kernel reads the table.

Rows also remember how much of their slot list they share with the first row seen on the same
first slot (`shared_len`), so a forward's shared-prefix groups come from per-row facts kept
across steps (O(batch) per step) instead of a search of every row's slot list. Steady decoding
over the same rows asks the same question each step and gets the same answer (`_Carried`):
it is kept, and given again without a look at any row while nothing but appends happened.

The last row is the scratch row: entry 0 holds the KV pool's scratch slot, read by the padding
rows of a padded decode batch (a one-token context).
"""

from __future__ import annotations

import numpy as np
import torch

from ..shared_prefix.groups import MAX_PREFIX_GROUPS, PrefixGroup
from ..shared_prefix.shape import MIN_SHARED_PREFIX

# Shared lengths of one first slot split into at most this many levels before grouping (a
# batch has a handful of prompts; more levels are merged down, never a wrong claim).
MAX_LEVELS = 16


class SlotTable:
    def __init__(
        self,
        rows: int,
        width: int,
        scratch_slot: int,
        device: torch.device | str = "cpu",
        max_width: int | None = None,
    ) -> None:
        if rows < 1 or width < 1:
            raise ValueError("a slot table needs at least one row and one column")
        self.device = torch.device(device)
        self.scratch_slot = scratch_slot
        # Rows can hold at most max_width slots (a request never holds two equal slots, so the
        # pool's size bounds it); width doubles up to that on demand.
        self.max_width = max(width, max_width or width)
        self._free: list[int] = []
        self._held = np.zeros(0, dtype=bool)
        self.shared_len = np.zeros(0, np.int64)  # per row: slots shared with its reference
        self._checked = np.zeros(0, np.int64)  # per row: how far shared_len was checked
        self._final = np.zeros(0, dtype=bool)  # per row: it differs from its reference
        self._refs: dict[int, _Reference] = {}  # first slot -> its reference slot row
        self._key = np.full(0, -1, np.int64)  # per row: the first slot its reference is under
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        # Bumped by every change but an append to a row (acquire, release, write, patch, a
        # move of the storage): the kept groups (_carried) hold while it stays.
        self.version = 0
        self._carried: _Carried | None = None
        self.groups_kept = 0  # prefix_groups calls answered from the kept answer (_Carried)
        self.generation = 0  # bumped when the storage moves (CUDA graphs hold its address)
        self.host = np.zeros((0, 1), np.int64)
        self._allocate(rows, width)

    # -- storage -------------------------------------------------------------------------

    def _allocate(self, rows: int, width: int) -> None:
        """(Re)allocates the storage for `rows` rows of `width`, keeping what rows hold."""
        host = np.zeros((rows + 1, width), np.int64)
        old_rows = len(self._held)
        if old_rows:
            keep = min(width, self.width)
            host[:old_rows, :keep] = self.host[:old_rows, :keep]
        host[rows, 0] = self.scratch_slot
        self.host = host
        self.flat_host = host.reshape(-1)
        if self.device.type == "cpu":
            self.table = torch.from_numpy(host)  # one memory: host writes are device writes
        else:
            self.table = torch.from_numpy(host).to(self.device)
            self._pending.clear()  # the copy above carries every write so far
        self.flat = self.table.view(-1)
        grow = rows - old_rows
        self._free = list(range(rows - 1, old_rows - 1, -1)) + self._free
        self._held = np.concatenate((self._held, np.zeros(grow, dtype=bool)))
        self.shared_len = np.concatenate((self.shared_len, np.zeros(grow, np.int64)))
        self._checked = np.concatenate((self._checked, np.zeros(grow, np.int64)))
        self._final = np.concatenate((self._final, np.zeros(grow, dtype=bool)))
        self._key = np.concatenate((self._key, np.full(grow, -1, np.int64)))
        self.generation += 1
        self.version += 1

    @property
    def rows(self) -> int:
        return len(self._held)

    @property
    def width(self) -> int:
        return int(self.host.shape[1])

    @property
    def scratch_start(self) -> int:
        """Flat index of the scratch row's one entry (padding rows start there, length 1)."""
        return self.rows * self.width

    @property
    def rows_held(self) -> int:
        return int(self._held.sum())

    def starts(self, rows: np.ndarray) -> np.ndarray:
        """Flat index of each row's first entry: the kernels' per-row slot-list start."""
        return rows * self.width

    def reserve(self, rows: int, width: int) -> None:
        """Storage for at least `rows` rows of `width` slots (capped at max_width) now, in one
        move: serving within them never moves it again, so CUDA graphs captured over it (which
        hold its address) stay valid."""
        rows, width = max(rows, self.rows), min(max(width, self.width), self.max_width)
        if rows > self.rows or width > self.width:
            self._allocate(rows, width)

    def _fit(self, length: int) -> None:
        if length > self.width:
            if length > self.max_width:
                raise ValueError(f"a row of {length} slots exceeds the table's {self.max_width}")
            self._allocate(self.rows, min(self.max_width, max(length, 2 * self.width)))

    # -- rows ----------------------------------------------------------------------------

    def acquire(self) -> int:
        """A free row (the table doubles its rows when none is left)."""
        if not self._free:
            self._allocate(2 * self.rows, self.width)
        row = self._free.pop()
        self.version += 1
        self._held[row] = True
        self.shared_len[row] = self._checked[row] = 0
        self._final[row] = False
        return row

    def release(self, row: int) -> None:
        if not self._held[row]:
            raise ValueError(f"slot-table row {row} is not held")
        self.version += 1
        self._held[row] = False
        self._forget_key(row)
        self._free.append(row)

    def write(self, row: int, start: int, slots: np.ndarray) -> None:
        """Row `row` holds `slots` at positions [start, start + len(slots))."""
        n = len(slots)
        if n == 0:
            return
        self._fit(start + n)
        self.version += 1  # admission's write (or any other): not an append the kept groups allow
        self.host[row, start : start + n] = slots
        if self.device.type != "cpu":
            flat = row * self.width + start + np.arange(n, dtype=np.int64)
            self._pending.append((flat, np.asarray(slots, np.int64).copy()))

    def scatter(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        """Entry (rows[i], positions[i]) holds slots[i], for every i (one vectorised write):
        appends, a forward's new slots at or past each row's length (a cached slot replacing
        one a row holds goes through patch, which the kept facts hear of)."""
        if len(slots) == 0:
            return
        self._fit(int(positions.max()) + 1)
        self.host[rows, positions] = slots
        if self.device.type != "cpu":
            flat = rows * self.width + positions
            self._pending.append((flat, np.asarray(slots, np.int64).copy()))

    def patch(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        """Entries a commit found cached already now hold the cache's slots (a tree's Dedup;
        the replaced slots go back to the allocator, to be reused). With overlapped scheduling
        a row's facts may have been checked over such an entry already (the next step was
        prepared before this one's commit): what was checked from the lowest patched position
        on is checked again, and a reference the row extends is cut back there, so no claim
        rests on a replaced slot."""
        self.scatter(rows, positions, slots)
        if len(rows) == 0:
            return
        self.version += 1
        order = np.lexsort((positions, rows))
        first = (np.diff(rows[order], prepend=-1) != 0).nonzero()[0]
        for r, lo in zip(
            rows[order][first].tolist(), positions[order][first].tolist(), strict=True
        ):
            if self._checked[r] <= lo:
                continue
            self._checked[r] = lo
            if self.shared_len[r] > lo:
                self.shared_len[r] = lo
                self._final[r] = False
            key = int(self._key[r])
            ref = self._refs.get(key) if key >= 0 else None
            if ref is not None and ref.owner == r and ref.length > lo:
                ref.length = lo

    def row(self, row: int, length: int) -> np.ndarray:
        """A view of the row's first `length` slots (no copy)."""
        return self.host[row, :length]

    def take_writes(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The device writes queued since the last call, as (flat index, slot) arrays; None
        when there are none (always on the CPU, where the table is the host array)."""
        if not self._pending:
            return None
        if len(self._pending) == 1:
            flat, vals = self._pending[0]
        else:
            flat = np.concatenate([p[0] for p in self._pending])
            vals = np.concatenate([p[1] for p in self._pending])
        self._pending.clear()
        return flat, vals

    # -- shared prefixes -----------------------------------------------------------------

    def _forget_key(self, row: int) -> None:
        key = int(self._key[row])
        if key < 0:
            return
        self._key[row] = -1
        ref = self._refs[key]
        ref.users -= 1
        if ref.owner == row:
            ref.owner = -1
        if ref.users == 0:  # nobody on it: a new prompt may start on this slot
            del self._refs[key]

    def _update_shared(self, rows: np.ndarray, caps: np.ndarray) -> np.ndarray:
        """Each row's shared length with the reference of its first slot, over its first
        caps[i] slots (caps >= 1).

        A row is compared once per slot at most: once it differs from its reference its
        shared length is final, so steady decoding compares nothing but the one row per
        reference that owns it (the reference grows with its owner's own slots, amortised
        O(1) a step). Rows only ever append (positions below a row's length never change
        while it is held), so a claim, once checked, stays true."""
        todo = ((caps > self._checked[rows]) & ~self._final[rows]).nonzero()[0]
        for i in todo.tolist():
            r, cap = int(rows[i]), int(caps[i])
            key = int(self._key[r])
            if key < 0:
                key = int(self.host[r, 0])
                ref = self._refs.get(key)
                if ref is None:
                    ref = self._refs[key] = _Reference(self.host[r, :cap], r)
                ref.users += 1
                self._key[r] = key
            ref = self._refs[key]
            shared = int(self.shared_len[r])
            if shared == ref.length < cap and ref.owner in (-1, r):
                ref.owner = r  # this row is the longest on the reference: it extends it
                ref.extend(self.host[r, ref.length : cap])
            hi = min(cap, ref.length)
            diff = (self.host[r, shared:hi] != ref.slots[shared:hi]).nonzero()[0]
            if len(diff):
                self.shared_len[r] = shared + int(diff[0])
                self._final[r] = True
            else:
                self.shared_len[r] = hi
            self._checked[r] = cap
        shared_len: np.ndarray = self.shared_len[rows]
        return shared_len

    def prefix_groups(
        self,
        rows: np.ndarray,
        caps: np.ndarray,
        min_len: int = MIN_SHARED_PREFIX,
        max_groups: int = MAX_PREFIX_GROUPS,
    ) -> list[PrefixGroup]:
        """Candidate shared-prefix groups of a forward over table rows `rows` (batch order),
        each prefix capped so a row's new tokens come after it (caps = kv_len - q_len).

        Two rows on the same reference share at least the lesser of their shared lengths (both
        equal the reference up to it), so each group's claim holds slot for slot. Rows of one
        first slot are split by shared length into nested groups: a group takes every row
        sharing at least its P, the split chosen to save the most (rows x P). Rows on two
        prompts that part from the reference at the same place are grouped at that place (a
        conservative P). The max_groups saving the most are kept, ordered by first row.

        Asked again over the same rows (steady decoding, overlapped or serial) with caps no
        shorter, and nothing but appends since (`version`), the last answer is given again
        when it came from the steady shape (_Carried)."""
        kept = self._carried
        asked_min_len = min_len
        if (
            kept is not None
            and kept.version == self.version
            and _same(kept.rows, rows)
            and kept.min_len == min_len
            and kept.max_groups == max_groups
            and bool(np.less_equal(kept.caps, caps).all())
        ):
            self.groups_kept += 1
            return list(kept.groups)
        self._carried = None
        n = len(rows)
        if n < 2:
            return []
        min_len = max(min_len, 1)
        steady = int(caps.min()) >= min_len  # every row long enough (decoding): no selection
        if steady:
            eff = np.minimum(self._update_shared(rows, caps), caps)
        else:
            eff = np.zeros(n, np.int64)
            long = (caps >= min_len).nonzero()[0]
            eff[long] = np.minimum(self._update_shared(rows[long], caps[long]), caps[long])
        eligible = (eff >= min_len).nonzero()[0]
        groups: list[PrefixGroup] = []
        if len(eligible) >= 2:
            keys = self._key[rows[eligible]]
            if int(keys.min()) == int(keys.max()):  # one reference (one shared prompt): no split
                steady &= _top_alone(eff[eligible])
                groups = _nested_groups(eligible, eff[eligible])
            else:
                for key in np.unique(keys).tolist():
                    members = eligible[keys == key]
                    if len(members) >= 2:
                        steady &= _top_alone(eff[members])
                        groups += _nested_groups(members, eff[members])
            groups.sort(key=lambda g: -g.saved_reads)
            groups = sorted(groups[:max_groups], key=lambda g: g.rows[0])
        if steady:
            self._carried = _Carried(
                rows.copy(), caps.copy(), self.version, asked_min_len, max_groups, groups
            )
        return groups


class _Carried:
    """SlotTable.prefix_groups' last answer, kept for the same rows asked again (a copy of
    the rows: an array the caller passed may be written later). It holds while the table saw
    appends only, every row was long enough and, on every reference, the longest row stood
    alone above the others or every row on one level (_top_alone).

    Appends change no shared length but the reference owner's: a row's new slots are its
    own (fresh from the allocator, held by nobody else; a cached one comes through patch,
    which bumps the version), so only the owner, whose slots the reference grows with,
    shares more; a row that matched its reference up to its cap parts from it at the next
    slot, where its shared length already stood (or, longer than the reference, stays at
    its length). The owner is its reference's longest row. Alone above the others, its
    length is the least of no group with two rows (a group's P is its lowest level), so the
    split and every group stay as they were; on one level with the others, it rises alone
    above them and they keep the level, the one group's P. The eligible rows stay too
    (shared lengths only grow, caps are no shorter). One case gives less than a fresh look
    would, never more: a row that holds a new owner's slots (both from the tree) but was
    not compared past its cap when the owner changed shares more once its cap grows; the
    kept answer keeps its old, shorter claim until the next version bump. Every claim kept
    still holds slot for slot: slots below a row's cap change only by a versioned call."""

    __slots__ = ("caps", "groups", "max_groups", "min_len", "rows", "version")

    def __init__(
        self,
        rows: np.ndarray,
        caps: np.ndarray,
        version: int,
        min_len: int,
        max_groups: int,
        groups: list[PrefixGroup],
    ) -> None:
        self.rows, self.caps, self.version = rows, caps, version
        self.min_len, self.max_groups, self.groups = min_len, max_groups, list(groups)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return len(a) == len(b) and bool((a == b).all())


def _top_alone(shared: np.ndarray) -> bool:
    """One row's shared length is above every other's, or all are equal."""
    top = int((shared == shared.max()).sum())
    return top == 1 or top == len(shared)


class _Reference:
    """The slot row that rows on one first slot are compared with (a growable copy)."""

    def __init__(self, slots: np.ndarray, owner: int) -> None:
        self.slots = np.empty(max(16, 2 * len(slots)), np.int64)
        self.slots[: len(slots)] = slots
        self.length = len(slots)
        self.owner = owner  # the row whose own slots extend it (-1: none now)
        self.users = 0

    def extend(self, slots: np.ndarray) -> None:
        end = self.length + len(slots)
        if end > len(self.slots):
            grown = np.empty(2 * end, np.int64)
            grown[: self.length] = self.slots[: self.length]
            self.slots = grown
        self.slots[self.length : end] = slots
        self.length = end


def _nested_groups(members: np.ndarray, shared: np.ndarray) -> list[PrefixGroup]:
    """Rows (batch indices) sharing shared[i] slots with one reference, split into groups of
    consecutive shared-length levels (from the longest down) maximising the slots saved:
    a group of k rows whose least shared length is P saves (k - 1) x P."""
    lo = int(shared.min())
    if int((shared == lo).sum()) >= len(shared) - 1:
        # One level, or one row above all the others (steady decoding: the row extending the
        # reference): one group of every row at the lower level saves the most, as the
        # search below would find ((n - 1) x lo; the row above alone would form no group).
        return [PrefixGroup(tuple(sorted(members.tolist())), lo)] if len(members) >= 2 else []
    levels, counts = np.unique(shared, return_counts=True)
    levels, counts = levels[::-1], counts[::-1]  # longest first
    tops = levels  # per level: the longest shared length in it (a merged level holds several)
    if len(levels) > MAX_LEVELS:  # merge the shortest levels into the last kept one
        counts = np.concatenate((counts[: MAX_LEVELS - 1], [counts[MAX_LEVELS - 1 :].sum()]))
        tops = levels[:MAX_LEVELS]
        levels = np.concatenate((levels[: MAX_LEVELS - 1], [levels[-1]]))
    k = len(levels)
    # best[j]: the most saved by levels [0, j); cut[j]: where its last group starts.
    best = [0] * (k + 1)
    cut = [0] * (k + 1)
    csum = np.concatenate(([0], np.cumsum(counts))).tolist()
    lv, top = levels.tolist(), tops.tolist()
    for j in range(1, k + 1):
        best[j], cut[j] = best[j - 1], j  # level j-1 alone in no group
        for i in range(j):
            rows_in = csum[j] - csum[i]
            if rows_in >= 2:
                saved = best[i] + (rows_in - 1) * lv[j - 1]
                if saved > best[j]:
                    best[j], cut[j] = saved, i
    groups: list[PrefixGroup] = []
    j = k
    while j > 0:
        i = cut[j]
        if i == j:  # a level left out
            j -= 1
            continue
        p = lv[j - 1]
        sel = members[(shared <= top[i]) & (shared >= p)]  # every row the level counted
        groups.append(PrefixGroup(tuple(sorted(sel.tolist())), p))
        j = i
    return groups
