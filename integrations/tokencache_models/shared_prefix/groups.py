"""Which rows of a forward share a slot-list prefix, and the shared-prefix kernel's tile table.

A server holds several prompts at once (system prompts of different apps, few-shot templates,
one conversation's earlier turns): the radix tree hands every request on one prompt the same KV
slots, so a batch's rows fall into groups whose slot lists start alike. Each group's prefix is read
once per block of its query tokens (kernels/shared_prefix_attention.py); rows outside every group
read their whole slot list as before. One group holding every row is the single system prompt case.

Found on the host from the slot lists themselves (a caller's claim is never trusted): rows are
keyed by their first slot (rows that share anything share it), and each key's rows are split
greedily into groups that save the most reads. Host numpy, O(rows x P) compares.

The kernel's table: every query token of a group belongs to exactly one tile of at most
PrefixShape.tokens_per_block tokens of that group; rows outside every group (padding rows too)
get their empty prefix partials from their own decode / varlen kernel. So every token's prefix
split columns are written once, and the merge needs no mask, while one group takes exactly as
many tiles as the old single-prefix kernel took passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..arrays import has_duplicates
from .shape import MIN_SHARED_PREFIX, PrefixShape

# Groups a forward shares at most (the largest savings kept): CUDA graphs are captured per
# group count, each with the tiles that many groups can need.
MAX_PREFIX_GROUPS = 8
# Columns of one tile-table row: first token (index into the token list), token count, the
# anchor row's slot-list start, P.
TILE_FIELDS = 4


@dataclass(frozen=True)
class PrefixGroup:
    """Rows (ascending; the first is the anchor whose slots the kernel reads) whose slot lists
    start with the same `length` slots."""

    rows: tuple[int, ...]
    length: int

    @property
    def saved_reads(self) -> int:
        """Slot reads saved per layer and kv head if the prefix is read once."""
        return (len(self.rows) - 1) * self.length


def _common_len(kv_slots: np.ndarray, a: int, b: int, limit: int, guess: int = -1) -> int:
    """Leading entries kv_slots[a:] and kv_slots[b:] share, at most limit. guess: a likely
    answer (the previous row's), confirmed with one compare pass instead of a search."""
    x, y = kv_slots[a : a + limit], kv_slots[b : b + limit]
    ends = 0 <= guess <= limit and (guess == limit or x[guess] != y[guess])
    if ends and np.array_equal(x[:guess], y[:guess]):
        return guess
    diff = (x != y).nonzero()[0]
    return int(diff[0]) if len(diff) else limit


def _best_group(
    kv_slots: np.ndarray, starts: np.ndarray, caps: np.ndarray, rows: list[int], min_len: int
) -> tuple[list[int], int, list[int]]:
    """rows[0] as the anchor: the rows sharing >= min_len slots with it such that
    (members - 1) x P is largest. Returns (members, P, what each member after the anchor shares
    with it); P = 0 when no row shares enough."""
    anchor, others = rows[0], rows[1:]
    cap = int(caps[anchor])
    common = np.zeros(len(others), np.int64)
    guess = -1  # rows on one prompt all share the same length with the anchor
    for i, r in enumerate(others):
        guess = _common_len(kv_slots, starts[anchor], starts[r], min(cap, int(caps[r])), guess)
        common[i] = guess
    by_len = np.argsort(-common, kind="stable")
    enough = int((common >= min_len).sum())
    if enough == 0:
        return [anchor], 0, []
    # Taking the k rows that share the most: P = the k-th longest, saving k x P.
    k = int(np.argmax(common[by_len[:enough]] * np.arange(1, enough + 1))) + 1
    members = [anchor, *(others[i] for i in by_len[:k].tolist())]
    return members, int(common[by_len[k - 1]]), common[by_len[:k]].tolist()


def _may_share_more(
    kv_slots: np.ndarray, starts: np.ndarray, caps: np.ndarray, rows: list[int], length: int
) -> bool:
    """Whether two of rows (all sharing `length` slots) could share more: their slots at index
    `length` coincide. Then an anchor that is not among them might have cut them short."""
    idx = [r for r in rows if caps[r] > length]
    at = kv_slots[starts[idx] + length] if idx else np.zeros(0, np.int64)
    return has_duplicates(at)


def _plan(
    kv_slots: np.ndarray, starts: np.ndarray, caps: np.ndarray, rows: list[int], min_len: int
) -> tuple[list[int], int]:
    """The group to take next among rows (rows[0] first in line): (members, P). Candidates, all
    drawn from the anchor's best group S (whose rows share >= P0 slots pairwise): S itself; the
    members on a longer prompt, apart (nested prompts: rows on a prompt extending another);
    and, when two members agree past P0, the same with the next row as the anchor (the first
    diverged early). Each is valued by its saving plus what the rows of S it leaves can still
    save together, (left - 1) x P0."""
    taken, length, shares = _best_group(kv_slots, starts, caps, rows, min_len)
    if length == 0:
        return taken, 0
    candidates = [(taken, length)]

    def apart(members: list[int], p: int, common: list[int]) -> None:
        deeper = [r for r, c in zip(members[1:], common, strict=True) if c > p]
        if deeper:
            inner, inner_len, _ = _best_group(kv_slots, starts, caps, [members[0], *deeper], 1)
            candidates.append((inner, inner_len))

    apart(taken, length, shares)
    if len(taken) > 2 and _may_share_more(kv_slots, starts, caps, taken[1:], length):
        alt, alt_len, alt_shares = _best_group(kv_slots, starts, caps, taken[1:], min_len)
        if alt_len:
            candidates.append((alt, alt_len))
            apart(alt, alt_len, alt_shares)

    def value(c: tuple[list[int], int]) -> int:
        return (len(c[0]) - 1) * c[1] + max(len(taken) - len(c[0]) - 1, 0) * length

    return max(candidates, key=value)


def find_prefix_groups(
    kv_slots: np.ndarray,
    kv_offsets: np.ndarray,
    q_offsets: np.ndarray,
    num_real: int | None = None,
    min_len: int = MIN_SHARED_PREFIX,
    max_groups: int = MAX_PREFIX_GROUPS,
) -> list[PrefixGroup]:
    """groups_over_rows over the first num_real rows (default all) of a concatenated slot list
    with offsets kv_offsets, each prefix capped so the rows' new tokens come after it
    (P <= kv_len - q_len)."""
    n = len(kv_offsets) - 1 if num_real is None else num_real
    caps = np.diff(kv_offsets[: n + 1]) - np.diff(q_offsets[: n + 1])
    return groups_over_rows(kv_slots, kv_offsets[:n], caps, min_len, max_groups)


def groups_over_rows(
    kv_slots: np.ndarray,
    starts: np.ndarray,
    caps: np.ndarray,
    min_len: int = MIN_SHARED_PREFIX,
    max_groups: int = MAX_PREFIX_GROUPS,
) -> list[PrefixGroup]:
    """Disjoint groups of >= 2 rows (row i's slots at kv_slots[starts[i]:], caps[i] of them
    eligible) whose slot lists share >= min_len (at least 1) leading entries. Among rows with
    the same first slot, the first row left anchors a group of the rows that keep
    (members - 1) x P largest, unless the group without it saves more (an anchor that diverges
    early) or the members sharing more than P with it do, grouped apart from the others
    (nested prompts: rows on a prompt that extends another); the rest try again. The
    max_groups saving the most are kept, ordered by their first row. A search of the slot
    lists, O(rows x P): the engine's slot table keeps the same facts per row instead
    (SlotTable.prefix_groups)."""
    min_len = max(min_len, 1)
    eligible = (caps >= min_len).nonzero()[0]
    if len(eligible) < 2:
        return []
    first = kv_slots[starts[eligible]]
    order = np.argsort(first, kind="stable")
    _, bounds = np.unique(first[order], return_index=True)
    groups: list[PrefixGroup] = []
    for lo, hi in zip(bounds.tolist(), [*bounds[1:].tolist(), len(order)], strict=True):
        left = eligible[order[lo:hi]].tolist()
        while len(left) >= 2:
            taken, length = _plan(kv_slots, starts, caps, left, min_len)
            if length == 0:
                left = left[1:]  # the anchor shares too little with anyone
                continue
            groups.append(PrefixGroup(tuple(sorted(taken)), length))
            chosen = set(taken)
            left = [r for r in left if r not in chosen]
    groups.sort(key=lambda g: -g.saved_reads)
    return sorted(groups[:max_groups], key=lambda g: g.rows[0])


@dataclass(frozen=True)
class PrefixTables:
    """The shared-prefix kernel's host tables for one forward (all int64).

    row_skip [rows]: the prefix each row's own kernels skip (its group's P, else 0);
    tiles [num_tiles, TILE_FIELDS]: (first token in `tokens`, token count, anchor's slot-list
    start, P), padded with empty tiles up to a graph's fixed count; tokens: the groups' query
    tokens, grouped by tile (padded with 0 to a graph's buffer)."""

    groups: tuple[PrefixGroup, ...]
    row_skip: np.ndarray
    tiles: np.ndarray
    tokens: np.ndarray

    @property
    def num_tiles(self) -> int:
        return len(self.tiles)

    @property
    def longest(self) -> int:
        return max((g.length for g in self.groups), default=0)

    def arrays(self) -> list[np.ndarray]:
        """What travels to the device, in this order: row_skip, tiles (flat), tokens."""
        return [self.row_skip, self.tiles.reshape(-1), self.tokens]


def max_tiles(shape: PrefixShape, num_tokens: int, groups: int = MAX_PREFIX_GROUPS) -> int:
    """The most tiles `groups` groups over num_tokens query tokens need: one pass's worth
    over all their tokens, plus a partial tile for every group but one."""
    return shape.passes(num_tokens) + max(groups, 1) - 1


def prefix_tables(
    groups: Sequence[PrefixGroup],
    q_offsets: np.ndarray,
    kv_starts: np.ndarray,
    shape: PrefixShape,
    num_tiles: int | None = None,
) -> PrefixTables:
    """The tile table for groups over a batch with q_offsets and rows starting at kv_starts
    in the slot buffer (a slot list's kv_offsets serve as well; padding rows included: they
    fall outside every group); num_tiles pads it with empty tiles and the token
    list to every query token's length (a CUDA graph's fixed grid and buffer), None keeps both
    exact."""
    rows = len(q_offsets) - 1
    row_skip = np.zeros(rows, np.int64)
    per_tile = shape.tokens_per_block
    token_parts: list[np.ndarray] = []
    tiles: list[tuple[int, int, int, int]] = []
    begin = 0
    for g in groups:
        idx = np.asarray(g.rows, np.int64)
        row_skip[idx] = g.length
        # The rows' query tokens, in row order: q_offsets[r] + 0, 1, ... for each row r.
        starts = q_offsets[idx]
        lens = q_offsets[idx + 1] - starts
        first = np.cumsum(lens) - lens
        toks = np.repeat(starts - first, lens) + np.arange(int(lens.sum()), dtype=np.int64)
        token_parts.append(toks)
        anchor = int(kv_starts[g.rows[0]])
        for t0 in range(0, len(toks), per_tile):
            tiles.append((begin + t0, min(per_tile, len(toks) - t0), anchor, g.length))
        begin += len(toks)
    table = np.array(tiles, np.int64).reshape(-1, TILE_FIELDS)
    tokens = np.concatenate(token_parts) if token_parts else np.zeros(0, np.int64)
    if num_tiles is not None:
        if len(table) > num_tiles:
            raise ValueError(f"{len(table)} prefix tiles do not fit a table of {num_tiles}")
        table = np.concatenate((table, np.zeros((num_tiles - len(table), TILE_FIELDS), np.int64)))
        tokens = np.concatenate((tokens, np.zeros(int(q_offsets[-1]) - len(tokens), np.int64)))
    return PrefixTables(tuple(groups), row_skip, table, tokens)


def paying_groups(
    groups: Sequence[PrefixGroup], q_offsets: np.ndarray, shape: PrefixShape, decode: bool
) -> list[PrefixGroup]:
    """The groups worth the shared-prefix path: those whose prefix, read once per tile of their
    query tokens, costs less than every row reading it; none unless their savings together
    beat the split partials that every query token (padding rows included: all of q_offsets)
    then writes and merges (prefix_traffic). Long catch-ups and prefills (many tiles), short
    prefixes and lone small groups in a large batch read per row."""
    if not groups:
        return []
    q_lens = np.diff(q_offsets)
    kept = [
        g
        for g in groups
        if g.length >= MIN_SHARED_PREFIX
        and shape.passes(_query_tokens(g, q_lens, decode)) < len(g.rows)
    ]
    skipped, read = prefix_traffic(kept, q_offsets, shape, decode)
    return kept if read < skipped else []


def _query_tokens(g: PrefixGroup, q_lens: np.ndarray, decode: bool) -> int:
    """The group's rows' query tokens (decode: one a row)."""
    return len(g.rows) if decode else int(q_lens[list(g.rows)].sum())


def prefix_traffic(
    groups: Sequence[PrefixGroup],
    q_offsets: np.ndarray,
    shape: PrefixShape,
    decode: bool,
) -> tuple[int, int]:
    """(skipped, read) in KV slots per layer: what the groups' rows no longer read themselves
    (rows x P each) and what the prefix path reads instead (each P once per tile of its
    group's query tokens, plus every query token's split partials). No groups: (0, 0)."""
    if not groups:
        return 0, 0
    q_lens = np.diff(q_offsets)
    skipped = read = 0
    for g in groups:
        skipped += len(g.rows) * g.length
        read += g.length * shape.passes(_query_tokens(g, q_lens, decode))
    longest = max(g.length for g in groups)
    num_tokens = int(q_offsets[-1] - q_offsets[0])
    read += shape.overhead_slots(num_tokens, None if decode else longest)
    return skipped, read
