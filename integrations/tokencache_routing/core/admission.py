"""Admission and memory: who enters the small model's batch (FCFS up to max_admitted, the
shared-prefix hold-back), and how a forward that does not fit makes room (evict cached KV,
then preempt the newest request)."""

from __future__ import annotations

from collections.abc import Callable

from .holdback import PrefillIndex
from .kv import ModelSide
from .request_lists import RequestLists
from .state import LARGE, SMALL, Request


class WaitForMemory(Exception):
    """make_room: only requests inside the other model's running forward could free memory."""


class Admission(RequestLists):
    """The scheduler's admission and its room-making (a part of Scheduler)."""

    def admit(self, not_after: float | None = None) -> None:
        """Waiting requests in arrival order (FCFS) while fewer than max_admitted are admitted:
        a place that frees (a request finishes) is taken at the next admission. Not gated by
        the small batch: requests back from catch-ups refill it beyond max_running, and a gate
        there kept the queue out while others came and went (requests waited for
        the whole batch to drain); the batch cap and its longest-waiting-first order
        (schedule_small) share the small model among everyone admitted instead.
        One documented exception to FCFS: a request sharing an uncached prompt page with one
        admitted but not yet prefilled is held back (it then matches that prefill in the tree
        instead of computing it again) and later arrivals pass it meanwhile: it waits for that
        request's first step, its turn in schedule_small's longest-waiting-first order. Nothing
        is admitted after a preemption until a request finishes (no two requests preempting
        each other), nor, in the event loop, past its small clock (not_after)."""
        cfg = self.cfg
        if self.admit_blocked and self.active():
            return
        self.admit_blocked = False
        if not self.waiting or self.num_active() >= cfg.max_admitted:
            return  # nothing to admit, or no place for it
        if not_after is not None and self.waiting[0].submitted_at > not_after:
            return  # the first in line has not arrived yet on this clock
        small_page = self.sides[SMALL].page_size
        held: list[Request] = []
        # Requests whose prefill in the small model has not run to its end (the only ones
        # that can hold anyone back: the index keeps no other), indexed so a burst of
        # arrivals costs a lookup each. Admitted ones join it (not prefilled yet).
        prefilling = PrefillIndex(
            SMALL, small_page, self.running + self.busy if self.holdback else ()
        )
        cached = self._cached_len(SMALL)
        while self.waiting and self.num_active() < cfg.max_admitted:
            r = self.waiting.popleft()
            if not_after is not None and r.submitted_at > not_after:
                self.waiting.appendleft(r)
                break
            if prefilling.holds(r, cached):  # empty, never holding, without the hold-back
                self.stats.held_back += 1
                held.append(r)
                continue
            r.kv = [self.handle_cls(self.sides[SMALL]), self.handle_cls(self.sides[LARGE])]
            if r.admit_order < 0:  # a preempted request keeps its seniority (FCFS victims)
                r.admit_order = self.admitted
                self.admitted += 1
            r.last_small_step = self.stats.steps
            self.running.append(r)
            if self.holdback:
                prefilling.add(r)
        self.waiting.extendleft(reversed(held))  # first in line at the next admission

    def _cached_len(self, kind: int) -> Callable[[Request], int]:
        """How much of a request's prompt this model's tree holds (a shared system prompt that
        is cached already is no reason to hold anyone back)."""
        side = self.sides[kind]

        def cached(r: Request) -> int:
            return side.cached_prefix_len(r.seq[: r.n - 1])

        return cached

    def preempt(self, r: Request) -> None:
        """Drop a request's KV in both models; it is recomputed from its tokens later."""
        self._remove(r)
        self._release(r)
        r.kv = []
        r.held_catchup = r.partial_prefill = False
        self.waiting.appendleft(r)
        self.stats.preemptions += 1
        # No re-admission until a request finishes: otherwise two requests can keep preempting
        # each other. The oldest request is never preempted, so it always makes progress.
        self.admit_blocked = True

    def make_room(
        self,
        side: ModelSide,
        batch: list[Request],
        kind: int,
        need_of: Callable[[list[Request]], int],
        need: int | None = None,
    ) -> None:
        """Evict cached KV, then preempt the newest requests, until the batch's tokens fit
        (need_of(batch): the new KV slots of this step's chunks, Scheduler._plan; need: the
        batch's as given, when the caller planned it already). Raises WaitForMemory when only
        busy requests (a forward running now) could give memory back, MemoryError when
        nothing can."""
        while batch:
            if need is None:
                need = need_of(batch)
            if side.pool.available >= need:
                return
            side.evict(need - side.pool.available)
            if side.pool.available >= need:
                return
            listed = self.active()  # once: per batch row it made this O(batch x active)
            on_list = {id(q) for q in listed}
            active = listed + [r for r in batch if id(r) not in on_list]
            oldest = min(active, key=lambda q: q.admit_order)
            victims = [q for q in active if not q.busy and q is not oldest]
            if not victims:
                if any(q.busy for q in active):
                    raise WaitForMemory
                raise MemoryError(f"{side.name} KV pool too small for one request")
            victim = max(victims, key=lambda q: q.admit_order)
            if victim in batch:
                batch.remove(victim)
            self.preempt(victim)
            need = None  # the batch may have lost a row: planned again
