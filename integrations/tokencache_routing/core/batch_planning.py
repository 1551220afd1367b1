"""The next forward of each model: a small step (at most max_running requests, the longest
waiting first; with overlap, the rows that continue the step still running) and a catch-up
(when one is due, on launch_policy.py's rules and prices, and its batch: take_catchup_batch's
shared-first-page hold-back); then each row's tokens under the token budget (chunked
prefill), its KV attached and allocated, room made first."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter

import numpy as np

from .admission import Admission, WaitForMemory
from .batch import PreparedForward, RowPlan, attach_all, chunk_ends, prepare_forward
from .holdback import take_catchup_batch
from .launch_policy import MeasuredPrices, hole_loss_s, launch_large, parked_catchup_fixed_s
from .state import LARGE, SMALL, Request

# Per-request reads of a step, mapped over its batch in C (a generator or a lambda would be a
# Python call per request per step).
_STEP_ORDER = attrgetter("last_small_step", "admit_order")  # who waited longest steps first
_LENGTH = attrgetter("length")  # a handle's committed tokens
_N = attrgetter("n")  # a request's tokens so far


class BatchPlanning(Admission):
    """The scheduler's choice and preparation of forwards (a part of Scheduler)."""

    def schedule_small(self, after: PreparedForward | None = None) -> PreparedForward | None:
        """At most max_running ready requests, those that waited longest first. More are
        ready than the cap when requests back from a catch-up find their places refilled
        (admission fills max_admitted): the most recently stepped wait a step rather than
        overfill the batch, so nobody waits more than about ready / max_running steps.
        after: the small step launched and not finished yet (overlap): its requests, which
        stepped last, fill the places left and continue it with its drawn token (a request
        whose drawn token is certainly its last does not) or, a prompt chunked there, with
        the next chunk; those it parks or ends are then dropped from this step
        (PreparedForward.dropped)."""
        ready = sorted(
            [r for r in self.running if r.busy_model == -1],  # not busy (no call per request)
            key=_STEP_ORDER,
        )
        cap = self.cfg.max_running
        batch = ready[:cap]
        ahead: dict[int, int] = {}
        if len(batch) == len(self.running):  # all of it (batch is a part of it)
            self.running = []
        elif batch:  # the ready ones leave the running list (a busy request is never on it)
            chosen = {id(r) for r in batch}
            self.running = [r for r in self.running if id(r) not in chosen]
        source = None  # each row's row in `after` (-1: none), once a row continues it
        if after is not None and len(batch) < cap:
            # A chunk short of its end goes on with the next chunk; a drawn token, when there
            # is room for one after it (its place is kv_lens: the step before `after` is
            # committed). As arrays: this runs once per request per step.
            prev = after.batch
            goes_on = after.kv_lens + 1 < after.facts.limit
            if after.any_incomplete:
                goes_on |= after.incomplete
            goes_on &= np.fromiter(
                (r.finished_reason is None and not r.abort_requested for r in prev),
                np.bool_,
                len(prev),
            )
            if after.dropped:
                goes_on[list(after.dropped)] = False
            rows = goes_on.nonzero()[0][: cap - len(batch)]
            if len(rows):
                if len(rows) == len(prev):
                    went_on: Sequence[Request] = prev
                else:
                    went_on = [prev[i] for i in rows.tolist()]
                ahead = dict(zip(map(id, went_on), rows.tolist(), strict=True))
                if batch:
                    source = np.full(len(batch) + len(rows), -1, np.int64)
                    source[len(batch) :] = rows
                else:  # only `after`'s rows (steady decoding): their rows there
                    source = rows
                batch += went_on
        if not batch:
            return None
        deferred: list[Request] = []  # left out by the token budget: next step, first
        try:
            prep = self._prepare(batch, SMALL, deferred, after, ahead, source)
        except WaitForMemory:
            self.running += [r for r in batch if id(r) not in ahead]
            raise
        self.running += deferred
        if prep is not None:
            for r in prep.batch:  # after a memory wait they keep their turn
                r.last_small_step = self.stats.steps
            # What could run: every admitted unfinished request (the batch is busy now), up to
            # the batch target (a parked request whose place was refilled leaves no hole).
            could_run = min(self.cfg.max_running, self.num_active())
            self.stats.small_batch_sizes.append(len(prep.batch))
            self.stats.small_batch_capacity.append(max(could_run, len(prep.batch)))
            if self.parked and self.cfg.launch == "cost":
                self._charge_holes(prep, could_run)
        return prep

    def schedule_large(self) -> PreparedForward | None:
        """Every parked request (barrier) or the next catch-up batch (hold-back applied)."""
        if not self.parked:
            return None
        if self.barrier:
            batch, rest, held = list(self.parked), list[Request](), list[Request]()
        else:
            cap = self.cfg.max_large_batch or len(self.parked)
            page = self.sides[LARGE].page_size
            cached = self._cached_len(LARGE)
            batch, rest, held = take_catchup_batch(self.parked, cap, LARGE, page, cached)
        self.parked = rest
        deferred: list[Request] = []  # left out by the token budget: the next catch-up's
        try:
            prep = self._prepare(batch, LARGE, deferred)
        except WaitForMemory:
            for r in held:  # not launched: they were not held behind a computed prefill
                r.held_catchup = False
            self.parked = batch + self.parked
            raise
        self.parked = deferred + self.parked
        if prep is not None:
            self.stats.large_held_back += len(held)
            self.hole_loss_s = 0.0  # ski rental: bought; the holes from here on count anew
            self._large_cached.clear()
        return prep

    def _plan(
        self,
        batch: Sequence[Request],
        kind: int,
        after: PreparedForward | None,
        ahead: dict[int, int],
        source: np.ndarray | None = None,
    ) -> RowPlan:
        """Where each row's tokens of this step start and end (chunk_ends under the token
        budget), as arrays: a row continuing the in-flight forward `after` (ahead: id ->
        its row there) takes one token after that row's, or the rest of its prompt after a
        chunk there that stopped short. O(batch) array work; the per-row chunk rule runs only
        when the pending tokens exceed the budget. source: each row's row in `after`, when the
        caller knows it (else from ahead)."""
        n = len(batch)
        handles = [r.kv[kind] for r in batch]
        if not ahead or after is None:
            source = None
        elif source is None:
            source = np.fromiter(map(ahead.get, map(id, batch), repeat(-1)), np.int64, n)
        if source is None or after is None:
            starts = np.fromiter(map(_LENGTH, handles), np.int64, n)
            fulls = np.fromiter(map(_N, batch), np.int64, n)
        elif (source >= 0).all():  # every row continues `after` (steady decoding)
            starts = after.kv_lens[source]
            fulls = starts + 1  # its drawn token, or the rest of a chunked prompt (below)
            if after.any_incomplete:
                for i in after.incomplete[source].nonzero()[0].tolist():
                    fulls[i] = batch[i].n
        else:  # continued rows from `after`'s arrays, only the others from their requests
            starts, fulls = np.empty(n, np.int64), np.empty(n, np.int64)
            cont, fresh = (source >= 0).nonzero()[0], (source < 0).nonzero()[0]
            starts[cont] = after.kv_lens[source[cont]]
            fulls[cont] = starts[cont] + 1  # its drawn token, or the rest of a chunked prompt
            for i in cont[after.incomplete[source[cont]]].tolist():
                fulls[i] = batch[i].n
            if len(fresh):
                idx = fresh.tolist()
                starts[fresh] = np.fromiter((handles[i].length for i in idx), np.int64, len(idx))
                fulls[fresh] = np.fromiter((batch[i].n for i in idx), np.int64, len(idx))
        budget = self.cfg.token_budget(kind)
        ends = fulls
        if 0 < budget < int((fulls - starts).sum()):
            chunked = chunk_ends(batch, kind, budget, starts.tolist(), fulls.tolist())
            ends = np.asarray(chunked, dtype=np.int64)
        return RowPlan(handles, starts, fulls, ends, source)

    def _prepare(
        self,
        batch: list[Request],
        kind: int,
        deferred: list[Request],
        after: PreparedForward | None = None,
        ahead: dict[int, int] | None = None,
        source: np.ndarray | None = None,
    ) -> PreparedForward | None:
        """Attach, make room and allocate; the batch becomes busy. Requests the token budget
        gives nothing this step leave the batch for `deferred` (the caller lists them again;
        one continuing `after` is not listed: it stays busy there, and goes on once that
        finishes). ahead: id(request) -> its row in the in-flight forward `after` it
        continues (those are busy already); source: each row's row there (-1: none), when the
        caller knows it. On an allocator or tree error the batch fails (released), never
        leaks."""
        side = self.sides[kind]
        ahead = ahead or {}
        try:
            if len(ahead) < len(batch):  # else every row continues `after` (ahead is a part
                # of batch here): attached there
                attach_all(batch if not ahead else [r for r in batch if id(r) not in ahead], kind)
            plan = self._plan(batch, kind, after, ahead, source)
            if side.pool.available < plan.need:  # evict, or preempt (rare: plan again after)
                rows = len(batch)
                self.make_room(
                    side, batch, kind, lambda b: self._plan(b, kind, after, ahead).need, plan.need
                )
                if len(batch) != rows:  # a row was preempted; eviction changes no row's plan
                    plan = self._plan(batch, kind, after, ahead)
            run = plan.ends > plan.starts
            if not run.all():  # the token budget gives these nothing this step
                for i in (~run).nonzero()[0].tolist():
                    r = batch[i]
                    if ahead.pop(id(r), None) is None:
                        deferred.append(r)
                batch[:] = [batch[i] for i in run.nonzero()[0].tolist()]
                plan = plan.take(run)
            if not batch:
                return None
            prep = prepare_forward(side, batch, kind, plan, after)
        except WaitForMemory:
            raise
        except Exception as e:
            self.fail(batch + deferred, e)
            deferred.clear()
            return None
        if plan.source is None:
            fresh = batch
        else:
            new_rows = (plan.source < 0).nonzero()[0]
            if not len(new_rows):  # every row continues `after`: busy there already
                return prep
            fresh = [batch[i] for i in new_rows.tolist()]
        for r in fresh:
            r.busy_model = kind
        self.busy += fresh
        return prep

    # ------------------------------------------------------------ catch-up launches

    def launch_due(self, waited_out: bool, own_device: bool) -> bool:
        """launch_policy.launch_large on this scheduler's settings and state (both drivers ask
        it). A catch-up whose last chunk has not run yet goes on at once."""
        if not self.parked:  # nothing to catch up (launch_large's first answer, sooner)
            return False
        waited_out = waited_out or any(r.partial_prefill for r in self.parked)
        cost = self.cfg.launch == "cost"
        return launch_large(
            self.cfg,
            len(self.parked),
            waited_out,
            self.num_on_small(),
            self.num_active(),
            own_device,
            self.hole_loss_s,
            self.catchup_fixed_s() if cost and not waited_out and not own_device else 0.0,
        )

    def catchup_fixed_s(self) -> float:
        """The fixed cost of a catch-up of the parked requests now (max_large_batch of them at
        most: launch_policy.parked_catchup_fixed_s), on the engine's prices; 0 without
        prices."""
        price = self.prices
        if price is None:
            return 0.0
        batch = self.parked[: self.cfg.max_large_batch or len(self.parked)]
        return parked_catchup_fixed_s(
            price, [r.n for r in batch], [self._large_context(r) for r in batch]
        )

    def _large_context(self, r: Request) -> int:
        """The tokens of r the large model holds KV for: its handle's length, or before its
        first catch-up what the large tree has cached of its prompt (a shared system prompt:
        matched once per request, kept until the next launch)."""
        if len(r.kv) > LARGE and r.kv[LARGE].attached:
            return r.kv[LARGE].length
        known = self._large_cached.get(id(r))
        if known is None:
            known = self._large_cached[id(r)] = self._cached_len(LARGE)(r)
        return known

    def _charge_holes(self, prep: PreparedForward, could_run: int) -> None:
        """launch="cost": add what this small step loses to the places parked requests leave
        empty (nobody refilled them: up to could_run, the batch target), priced with the
        parked requests' mean context (hole_loss_s)."""
        holes = min(len(self.parked), could_run - len(prep.batch))
        price = self.prices
        if holes <= 0 or price is None:
            return
        mean_ctx = sum(r.n for r in self.parked) / len(self.parked)
        kv = int(prep.kv_lens.sum())
        self.hole_loss_s += hole_loss_s(
            price, len(prep.batch), prep.num_tokens, kv, holes, round(holes * mean_ctx)
        )

    def observe_forward(self, kind: int, seconds: float) -> None:
        """A forward's measured time, for prices that learn from them (MeasuredPrices)."""
        prices = self.prices
        if isinstance(prices, MeasuredPrices):
            prices.observe(kind, seconds)
