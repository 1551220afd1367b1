"""A model side's batched forward (used by the scheduler): attach, chunking, preparation,
launch and commit. Who goes in a batch and who is held back: holdback.py."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from tokencache_models import DeferredTokens, ForwardOutput, HostBatch, ModelExecutor

from .kv import KVHandle, ModelSide
from .prefix import NO_PREFIX, PrefixRead
from .routers import Router
from .sampling import Decisions, Draw, draw, route
from .state import Request

# Per-request reads of a step, mapped over its batch in C (a generator expression would be a
# Python call per request per step).
_PROMPT_LEN = attrgetter("prompt_len")
_MAX_NEW = attrgetter("max_new_tokens")
_ROUTE_KEY = attrgetter("route_key")
_GREEDY = attrgetter("sampling.greedy")
_ROW = attrgetter("row")  # a handle's slot-table row


def attach_all(batch: Sequence[Request], kind: int) -> None:
    """Admission into this model: pin the longest cached prefix (first forward here)."""
    for r in batch:
        h = r.kv[kind]
        if not h.attached:
            h.attach(r.seq[: r.n])


def chunk_ends(
    batch: Sequence[Request],
    kind: int,
    budget: int,
    starts: Sequence[int] | None = None,
    fulls: Sequence[int] | None = None,
) -> list[int]:
    """Chunked prefill: per request (attached), the end of this step's tokens in r.seq, so the
    step computes at most `budget` tokens (0: no budget, every request's end is its full end).
    A row's pending tokens run from its start (its KV's length, or starts[i]) to its full end
    (r.n, or fulls[i]: a row continuing a step in flight has one, its deferred token).
    Decode rows (one pending token) go first, in batch order; the rest of the budget goes to
    the longer rows (prefills, catch-ups) in batch order, the last one it reaches taking a
    chunk of its tokens. A row the budget does not reach ends where it starts (no tokens this
    step: the scheduler leaves it out). Progress: when decode rows alone would take the whole
    budget, one token of it is kept for the first longer row, so a budget smaller than the
    batch never starves a prefill."""
    first = [r.kv[kind].length for r in batch] if starts is None else list(starts)
    full = [r.n for r in batch] if fulls is None else list(fulls)
    if budget <= 0:
        return full
    ends = list(first)
    decode = [i for i, (a, b) in enumerate(zip(first, full, strict=True)) if b - a == 1]
    longer = [i for i, (a, b) in enumerate(zip(first, full, strict=True)) if b - a > 1]
    left = budget
    for i in decode[: budget - 1 if longer else budget]:
        ends[i] += 1
        left -= 1
    for i in longer:
        if left <= 0:
            break
        take = min(full[i] - first[i], left)
        ends[i] += take
        left -= take
    return ends


@dataclass
class PreparedForward:
    """One forward's inputs with its new KV slots allocated. Whoever prepares it must end it
    with commit() (the handles take the slots) or discard() (the slots go back): nothing leaks
    when the forward, the router or a commit raises.

    Overlapped scheduling prepares a small step while the previous one still runs: a request of
    that step continues here (`ahead` rows), with its input token still on the device (the
    previous step's draw, resolved by the runner, DeferredTokens), or, when its chunk there
    stopped short of its prompt's end, with its next chunk (tokens known on the host). A row
    whose request the previous step parks or ends is dropped (`dropped`): computed, never
    committed, its slot freed."""

    side: ModelSide
    batch: list[Request]
    handles: list[KVHandle]
    q_off: np.ndarray
    kv_lens: np.ndarray  # per request: context after this forward (its token's index)
    tokens: np.ndarray
    new_slots: np.ndarray
    host: HostBatch  # the forward over the side's slot-table rows (new slots already in them)
    # Per request: its chunk stops short of its last pending token (chunked prefill): the
    # chunk's KV is committed, nothing is sampled, routed or delivered for it this step.
    incomplete: np.ndarray
    facts: RowFacts
    done: bool = False
    # Overlap: the in-flight forward this one continues, which rows do (ahead), those whose
    # input token is its draw (deferred_rows) and their rows there (source); dropped once
    # committed, so no chain of forwards stays referenced.
    after: PreparedForward | None = None
    ahead: np.ndarray | None = None
    deferred_rows: np.ndarray | None = None
    source: np.ndarray | None = None
    # The prefix groups a shared-prefix runner reads once and their traffic (GpuClock.prefix_of);
    # set by the engine when its GPU clock models one (NO_PREFIX: none, or not asked)
    shared_prefix: PrefixRead = NO_PREFIX
    # Measured by run() on the side's timer: the time spent inside the forward's device work
    # (the engine's host time for the step is the rest).
    execute_host_s: float = 0.0
    # After launch(): the forward's output and the tokens drawn from it, on the device.
    out: ForwardOutput | None = None
    drawn: Draw | None = None
    decided: Decisions | None = None  # the router's answers (small steps)
    resolved: np.ndarray | None = None  # the draw on the host, once the step is finished
    dropped: set[int] = dataclasses.field(default_factory=set)
    successor: PreparedForward | None = None  # the forward that continues this one's rows
    # incomplete.any(), asked several times a step (incomplete never changes).
    any_incomplete: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.any_incomplete = bool(self.incomplete.any())

    @property
    def num_tokens(self) -> int:
        return int(self.q_off[-1])

    def run(self, router: Router | None = None) -> tuple[ForwardOutput, float]:
        """The forward; returns its output and its device time (on CUDA synchronised, so the
        GPU time and not the launch time). The runner's host preparation before it is host
        time of the step, like the scheduling around it. Its epilogue computes each row's
        greedy token and what of the router's features the device can (device work)."""
        model, timer = self.side.model, self.side.timer
        step = model.prepare(self.host, self.side.pool, epilogue=self.side.epilogue(router))
        self.side.forward_paths[ModelExecutor.path_of(step)] += 1
        t1, w1 = timer(), time.perf_counter()
        out = model.execute(step)
        self.side.sync()
        w2 = time.perf_counter()
        self.execute_host_s = timer() - t1
        if out.logits.shape[-1] > self.side.vocab_size:  # a model's padding rows: never drawn
            out = dataclasses.replace(out, logits=out.logits[:, : self.side.vocab_size])
        return out, w2 - w1

    def launch(self, router: Router | None = None) -> float:
        """run(), the draw of each row's next token and (a small step: router given) the
        router's answers for the rows whose last chunk ran, all enqueued on the device before
        anything else is, their copies to the host under way (read when the step is finished,
        waiting for this step only); returns the forward's device time as run()."""
        out, dt = self.run(router)
        self.out = out
        self.drawn = draw(out.logits, self.batch, self.kv_lens, self.facts.sampled, out.greedy)
        if router is not None:
            rows, sel = self.complete(out)
            tokens, index, facts = self.drawn.tokens, self.kv_lens, self.facts
            if len(rows) < len(self.batch):
                done = (~self.incomplete).nonzero()[0]
                tokens = tokens[torch.from_numpy(done).to(tokens.device)]
                index, facts = index[done], facts.take(done)
            self.decided = route(
                router, sel, rows, tokens, index, facts.prompt_len, facts.route_key
            )
        return dt

    def live(self) -> list[bool]:
        """Rows whose request takes this forward's result: not dropped, not ended meanwhile."""
        live = [r.finished_reason is None for r in self.batch]
        for i in self.dropped:
            live[i] = False
        return live

    def complete(self, out: ForwardOutput) -> tuple[list[Request], ForwardOutput]:
        """The requests whose last chunk ran (every request, unless a chunk stopped short)
        and their rows of the output: what is sampled and routed."""
        if not self.any_incomplete:
            return self.batch, out
        rows = (~self.incomplete).nonzero()[0]
        sel = out.rows(torch.from_numpy(rows).to(out.logits.device))
        return [self.batch[i] for i in rows], sel

    def commit(self, live: list[bool] | None = None) -> None:
        """The live rows' handles extended in one call (duplicates of cached tokens freed by
        the handles); the other rows' new slots go back (live: the caller's live() of this
        step, else taken here). Deferred input tokens are known by now: the step they
        continue was finished, its draw resolved (`after.resolved`)."""
        if self.done:
            raise RuntimeError("forward already committed or discarded")
        self.done = True
        live = self.live() if live is None else live  # the caller's, taken just before
        every = all(live)
        if self.after is not None:
            rows, source = self.deferred_rows, self.source
            if rows is not None and source is not None and len(rows):
                if not every:  # only the live rows are fed
                    fed = np.asarray(live)[rows]
                    rows, source = rows[fed], source[fed]
                if len(rows):
                    if self.after.resolved is None:
                        raise RuntimeError("a forward committed before the one it continues")
                    self.tokens[self.q_off[rows]] = self.after.resolved[source]
            self.after = None
        if every:
            self.handles[0].commit_many(
                self.side, self.handles, self.q_off, self.tokens, self.new_slots
            )
            return
        alive = np.asarray(live, dtype=np.bool_)
        keep = alive.nonzero()[0]
        if self.num_tokens == len(alive):  # decode: a token a row (a row escalated, ended)
            take = alive
            q_off = _all_rows(len(keep) + 1)[1]  # 0, 1, ..., kept rows (read only)
        else:
            lens = np.diff(self.q_off)
            take = np.repeat(alive, lens)  # per token: its row is live
            q_off = np.zeros(len(keep) + 1, np.int64)
            np.cumsum(lens[keep], out=q_off[1:])
        self.side.free(self.new_slots[~take])
        if not len(keep):
            return
        handles = [self.handles[i] for i in keep.tolist()]
        handles[0].commit_many(self.side, handles, q_off, self.tokens[take], self.new_slots[take])

    def discard(self) -> None:
        if not self.done:
            self.done = True
            self.side.free(self.new_slots)


@dataclass(frozen=True)
class RowFacts:
    """What a forward's rows' requests keep while they run, as arrays (the sampler, the
    router and the scheduler read these instead of one attribute per request per step):
    prompt length, the sequence length at which a request ends by length (limit), the id
    routers see (route_key), and whether it samples (not greedy)."""

    prompt_len: np.ndarray
    limit: np.ndarray
    route_key: np.ndarray
    sampled: np.ndarray

    @classmethod
    def of(cls, batch: Sequence[Request]) -> RowFacts:
        n = len(batch)
        prompt = np.fromiter(map(_PROMPT_LEN, batch), np.int64, n)
        greedy = np.fromiter(map(_GREEDY, batch), np.bool_, n)
        return cls(
            prompt,
            prompt + np.fromiter(map(_MAX_NEW, batch), np.int64, n),
            np.fromiter(map(_ROUTE_KEY, batch), np.int64, n),
            ~greedy,
        )

    def take(self, rows: np.ndarray) -> RowFacts:
        return RowFacts(
            self.prompt_len[rows], self.limit[rows], self.route_key[rows], self.sampled[rows]
        )

    @classmethod
    def carried(
        cls, batch: Sequence[Request], source: np.ndarray | None, after: PreparedForward | None
    ) -> RowFacts:
        """The facts of `batch`, whose row i continues row source[i] of `after` (-1: none):
        those rows' facts come from there, only the others' from their requests."""
        if source is None or after is None:
            return cls.of(batch)
        cont = source >= 0
        if cont.all():
            n = len(after.batch)
            if len(source) == n and (source == np.arange(n)).all():
                return after.facts  # every row goes on, in its place (immutable: shared)
            return after.facts.take(source)
        fresh = (~cont).nonzero()[0]
        new = cls.of([batch[i] for i in fresh.tolist()])
        old = after.facts.take(source[cont])
        parts = []
        for a, b in zip(
            (old.prompt_len, old.limit, old.route_key, old.sampled),
            (new.prompt_len, new.limit, new.route_key, new.sampled),
            strict=True,
        ):
            col = np.empty(len(batch), a.dtype)
            col[cont], col[fresh] = a, b
            parts.append(col)
        return cls(*parts)


@dataclass
class RowPlan:
    """One forward's rows as arrays (Scheduler._plan): each row's handle, where its tokens of
    this step start and end in its sequence (ends < fulls: a chunk short of its last pending
    token) and the row of the in-flight forward it continues (source, -1: none; None: no row
    does)."""

    handles: list[KVHandle]
    starts: np.ndarray
    fulls: np.ndarray
    ends: np.ndarray
    source: np.ndarray | None

    @property
    def need(self) -> int:
        """The new KV slots the forward takes."""
        return int((self.ends - self.starts).sum())

    def take(self, keep: np.ndarray) -> RowPlan:
        """The plan of the rows where keep (a bool mask) is set."""
        rows = keep.nonzero()[0]
        return RowPlan(
            [self.handles[i] for i in rows.tolist()],
            self.starts[rows],
            self.fulls[rows],
            self.ends[rows],
            self.source[rows] if self.source is not None else None,
        )


def _all_rows(n: int) -> tuple[np.ndarray, np.ndarray]:
    """n Trues and arange(n), read only (kept per n): an in-place step's continuing rows and
    their places, the same each step."""
    kept = _ALL_ROWS.get(n)
    if kept is None:
        every, places = np.ones(n, np.bool_), np.arange(n, dtype=np.int64)
        every.flags.writeable = places.flags.writeable = False
        kept = _ALL_ROWS[n] = (every, places)
    return kept


_ALL_ROWS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def prepare_forward(
    side: ModelSide,
    batch: Sequence[Request],
    kind: int,
    plan: RowPlan,
    after: PreparedForward | None = None,
) -> PreparedForward:
    """A forward over each request's r.seq[plan.starts[i]:plan.ends[i]] (room already made).
    O(batch + new tokens): the new slots are appended to the requests' slot-table rows, which
    the runner reads in place; nothing is copied per context token. A row with
    plan.source[i] >= 0 continues that row of the in-flight forward `after`: one new token, at
    the place after that row's, whose id is `after`'s draw (still on the device: the runner
    resolves it), or, where that row's chunk stopped short of its end, the next chunk."""
    n = len(batch)
    handles, starts, full, ends = plan.handles, plan.starts, plan.fulls, plan.ends
    source = plan.source if after is not None else None
    dest = cont = None
    # Steady overlapped decoding: every row of `after` goes on, in its place, with its drawn
    # token (no chunk there). Its rows, deferred tokens and facts are then `after`'s as they
    # are: no per-row selection.
    in_place = (
        after is not None
        and source is not None
        and n == len(after.batch)
        and not after.any_incomplete
        and bool((source == np.arange(n)).all())
    )
    if in_place:
        assert after is not None and after.host.rows is not None
        cont, dest = _all_rows(n)
        rows = after.host.rows  # read only, here and there
    elif after is not None and source is not None:
        cont = source >= 0
        # A row continuing a chunk short of its end there takes its next chunk from the host;
        # the others take the token drawn there (deferred).
        chunk = np.zeros(n, np.bool_)
        chunk[cont] = after.incomplete[source[cont]]
        dest = (cont & ~chunk).nonzero()[0]
        assert after.host.rows is not None
        rows = np.empty(n, np.int64)  # a continued row keeps its table row
        rows[cont] = after.host.rows[source[cont]]
        if not cont.all():
            fresh = (~cont).nonzero()[0].tolist()
            rows[fresh] = np.fromiter((handles[i].row for i in fresh), np.int64, len(fresh))
    else:
        rows = np.fromiter(map(_ROW, handles), np.int64, n)
    if in_place and after is not None and after.num_tokens == n:
        q_off, total = after.q_off, n  # one token a row there and here: arange(n + 1), kept
    else:
        q_lens = ends - starts
        q_off = np.zeros(n + 1, dtype=np.int64)
        q_lens.cumsum(out=q_off[1:])  # the method: np.cumsum's wrappers are three more calls
        total = int(q_off[-1])
    if total == n:  # decode: each request's one token at its last position
        if dest is not None and len(dest) == n:  # all deferred: placeholders (the runner
            tokens = np.zeros(n, np.int64)  # writes the drawn ids over them)
        else:
            tokens = np.fromiter(
                (r.seq[e - 1] for r, e in zip(batch, ends.tolist(), strict=True)), np.int64, n
            )
        positions, token_rows = starts, rows
    else:  # rows fed a drawn token keep a placeholder (set below): only the others are read
        tokens = np.zeros(total, np.int64)
        own = np.ones(n, np.bool_)
        if dest is not None:
            own[dest] = False
        for i in own.nonzero()[0].tolist():
            tokens[q_off[i] : q_off[i + 1]] = batch[i].seq[starts[i] : ends[i]]
        positions = np.repeat(starts - q_off[:-1], q_lens) + np.arange(total, dtype=np.int64)
        token_rows = np.repeat(rows, q_lens)
    new_slots = side.alloc(total)
    src: np.ndarray | None = None  # the continued rows' sources of their input tokens
    try:  # until a PreparedForward owns them, nothing else would give these slots back
        side.table.scatter(token_rows, positions, new_slots)
        # In place, the rows' starts are `after`'s while the table's storage stayed put.
        kept = in_place and after is not None and after.host.kv_slots is side.table.flat_host
        host = HostBatch.from_table(
            side.table, rows, tokens, positions, new_slots, q_off, ends,
            kv_starts=after.host.kv_starts if kept and after is not None else None,
        )  # fmt: skip
        if after is not None and source is not None and dest is not None and len(dest):
            assert after.drawn is not None, "the forward continued from was not launched"
            src = source if in_place else source[dest]  # in place: both arange(n)
            if len(dest) < total:  # else tokens are all placeholders already (zeros)
                tokens[q_off[dest]] = 0  # placeholders (the runner writes the drawn ids)
            # Valid by construction: src rows of that draw, q_off[dest] distinct row starts
            # (in place: both arange(n), n the draw's length).
            host.deferred = DeferredTokens.of_rows(
                after.drawn.tokens, src, q_off[dest], in_place=in_place
            )
        if in_place and after is not None:
            facts = after.facts  # immutable: shared
        else:
            facts = RowFacts.carried(batch, source, after)
        prep = PreparedForward(
            side, list(batch), handles, q_off, ends, tokens, new_slots, host, ends < full, facts
        )
    except BaseException:
        side.free(new_slots)
        raise
    # Linked to the forward it continues last: nothing from here on raises.
    if after is not None and cont is not None and cont.any():
        prep.after, prep.ahead = after, cont
        after.successor = prep
    if src is not None:
        prep.deferred_rows, prep.source = dest, src
    return prep
