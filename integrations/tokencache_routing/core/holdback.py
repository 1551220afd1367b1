"""The shared-prefix hold-back (admission and catch-ups): a request sharing at least a page of
uncached prefix with one whose prefill has not run yet waits, so that it then matches the first
one's KV in the tree instead of prefilling the prefix again.

The question (overlaps_prefill) is asked of every request against every one admitted or taken
before it; PrefillIndex answers it from an index of those, so a batch of B first forwards costs
O(B) lookups, not B^2 / 2 comparisons (256 first forwards on one cached 8k prompt: 41 ms
pairwise, under 1 ms indexed; benches/test_holdback.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from .state import Request


def committed(q: Request, kind: int) -> int:
    """How many of q's tokens have their KV committed in this model: its handle's length once
    attached (chunked prefill: maybe part of its prompt; overlap: not what its step in flight
    computes), else none."""
    h = q.kv[kind] if q.kv else None
    return h.length if h is not None and h.attached else 0


def not_prefilled(q: Request, kind: int) -> bool:
    """Whether q's KV in this model is not committed up to its last token yet: its prefill
    (or a chunk of it) is still to run, or runs now. Only those can hold anyone back."""
    return committed(q, kind) < q.n - 1


class PrefillIndex:
    """Requests whose prefill in a model has not run to its end (or, chunked, not that far),
    indexed to answer overlaps_prefill. Members must not change (tokens, commits) while in.

    The definition: r is held by q when their common prefix (of what attach matches, seq[:-1])
    reaches a page past what the tree holds of r (known) and passes what q has committed
    (done): when they agree on their first max(N, done + 1) tokens, N = known + page. Every
    such q agrees with r on the page before N, so the members are filed by that page, a dict
    per N, and only those in r's bucket are compared. Requests on one cached prompt ask one N
    (and that page is where they part); a dict is made on the second ask for its N, the first
    scanning the members instead, so askers that each ask their own N (different prompts,
    multi-turn histories) cost what a scan does, not a dict each that every later member is
    filed into."""

    def __init__(self, kind: int, page_size: int, members: Iterable[Request] = ()) -> None:
        self.kind, self.page = kind, page_size
        self._members: list[Request] = []
        self._done: list[int] = []  # per member: committed when it came in
        self._by_window: dict[int, dict[bytes, list[int]]] = {}  # N -> seq[N - page:N] -> members
        self._asked: set[int] = set()  # the N asked once (no dict yet)
        for q in members:
            self.add(q)

    def __len__(self) -> int:
        return len(self._members)

    def add(self, q: Request) -> None:
        """q as a member (one prefilled already can hold nobody: not kept)."""
        done = committed(q, self.kind)
        if done >= q.n - 1:
            return
        i = len(self._members)
        self._members.append(q)
        self._done.append(done)
        for n, windows in self._by_window.items():
            self._file(windows, n, i, q)

    def _window(self, q: Request, n: int) -> bytes | None:
        """q's page before n, when q can share n tokens with an asker."""
        return q.seq[n - self.page : n].tobytes() if n <= q.n - 1 else None

    def _file(self, windows: dict[bytes, list[int]], n: int, i: int, q: Request) -> None:
        window = self._window(q, n)
        if window is not None:
            windows.setdefault(window, []).append(i)

    def holds(self, r: Request, cached: Callable[[Request], int] | None = None) -> bool:
        """overlaps_prefill(r, members): cached(r), how much of r the tree holds, is asked once
        when there is a member."""
        page = self.page
        last = r.n - 1  # attach matches seq[:-1]
        if not self._members or last < page:  # nobody to share a page with: the tree not asked
            return False
        n = (cached(r) if cached is not None else 0) + page
        if n > last:
            return False
        lo = n - page
        window = r.seq[lo:n].tobytes()
        windows = self._by_window.get(n)
        if windows is not None:
            bucket: Iterable[int] = windows.get(window, ())
        elif n in self._asked:  # asked again: worth a dict
            windows = self._by_window[n] = {}
            for i, q in enumerate(self._members):
                self._file(windows, n, i, q)
            bucket = windows.get(window, ())
        else:  # asked once: a scan
            self._asked.add(n)
            bucket = (i for i, q in enumerate(self._members) if self._window(q, n) == window)
        for i in bucket:
            q = self._members[i]
            need = max(n, self._done[i] + 1)  # <= q.n - 1: filed at n, and not prefilled
            if need > last:
                continue
            # They agree on [lo, n): past it first (where a member that committed more parts
            # from r), then before it.
            if np.array_equal(r.seq[n:need], q.seq[n:need]) and np.array_equal(
                r.seq[:lo], q.seq[:lo]
            ):
                return True
        return False


def overlaps_prefill(
    r: Request,
    running: Sequence[Request],
    kind: int,
    page_size: int,
    cached: Callable[[Request], int] | None = None,
) -> bool:
    """True when r shares at least a page of prefix that is not cached yet with a request
    whose prefill in this model has not run yet (or, chunked, not that far yet), or runs now
    (overlap: launched, not committed): admitted together, both would prefill it (the
    duplicate freed afterwards), so r waits and then matches the first one's KV in the tree
    instead. cached(r): how much of r the tree already holds (asked once at most). One
    question; a caller asking it of many requests keeps a PrefillIndex."""
    return PrefillIndex(kind, page_size, running).holds(r, cached)


def take_catchup_batch(
    parked: Sequence[Request],
    cap: int,
    kind: int,
    page_size: int,
    cached: Callable[[Request], int] | None = None,
) -> tuple[list[Request], list[Request], list[Request]]:
    """Splits parked requests into (catch-up batch, left parked, held back). A request
    making its first forward in this model (handle not attached) that shares at least a page of
    uncached prefix with another one being attached in this batch is held for the next batch,
    where it matches the first one's KV in the tree instead of prefilling the prefix again. A
    request held once is not held again (no starvation), unless behind a catch-up split in
    chunks (partial_prefill) that has not passed the shared prefix yet: that one is first in
    line and advances every catch-up; parked order is kept."""
    batch: list[Request] = []
    rest: list[Request] = []
    held: list[Request] = []
    taken = PrefillIndex(kind, page_size)
    chunked = False  # a request in the batch goes on with a chunk of its catch-up
    for r in parked:
        if len(batch) >= cap:
            rest.append(r)
        elif r.kv[kind].attached or (r.held_catchup and not chunked) or not taken.holds(r, cached):
            r.held_catchup = False
            batch.append(r)
            taken.add(r)
            chunked |= r.partial_prefill
        else:
            r.held_catchup = True
            rest.append(r)
            held.append(r)
    return batch, rest, held
