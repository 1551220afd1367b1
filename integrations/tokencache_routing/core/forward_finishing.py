"""A finished forward's results committed: each request's token appended and delivered, or
its request parked for a catch-up (an escalated small token) or ended (end_reasons says
why); a chunk short of its last token only commits its KV; a forward that failed ends its
live requests with its error."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tokencache_models import ForwardOutput

from .batch import PreparedForward
from .request_lists import RequestLists
from .sampling import draw, route
from .state import LARGE, SMALL, Request


def end_reasons(reqs: Sequence[Request], tokens: Sequence[int]) -> list[str | None]:
    """Why each request ends when its token is appended, or None when it goes on: "stop" for
    a stop or eos token, "length" once it has max_new_tokens. A stop token that is also the
    last token allowed ends it with "stop" (OpenAI's rule: a matched stop wins). The one
    place the rule lives: both models' tokens end through it (finish_small, commit_token), a
    step's rows in one call (no Python call per row: test_host_path counts them)."""
    return [
        "stop"
        if t in r.stop_token_ids
        else "length"
        if r.n + 1 - r.prompt_len >= r.max_new_tokens
        else None
        for r, t in zip(reqs, tokens, strict=True)
    ]


class ForwardFinishing(RequestLists):
    """The scheduler's commits of forwards' results (a part of Scheduler)."""

    def finish_small(self, prep: PreparedForward, out: ForwardOutput, now: float) -> list[Request]:
        """Commit the KV, route, then per request: park (escalated), append its token, or
        finish; a request whose prefill chunk stopped short only commits its KV and steps
        again. Returns the escalated requests. A request that continues in the step launched
        after this one (overlap) stays busy there; one parked or ended here is dropped from
        it."""
        st = self.stats
        nxt, prep.successor = prep.successor, None
        cont: dict[int, int] = {}  # id(request) -> its row in nxt
        rows_there: list[int] = []  # nxt's rows that continue this step's, in batch order
        if nxt is not None and nxt.ahead is not None:
            rows_there = nxt.ahead.nonzero()[0].tolist()
        # Every row continues in nxt (steady overlapped decoding): no id() per request below,
        # and cont is made only once a row leaves nxt (prep.batch is nxt's continuing rows, in
        # order). Only a row's own leaving (leave_next) takes it out of cont, so for every
        # other row "in cont" stays true.
        all_continue = len(rows_there) == len(prep.batch)
        if rows_there and not all_continue:
            went_on = [nxt.batch[i] for i in rows_there] if nxt is not None else []
            cont = dict(zip(map(id, went_on), rows_there, strict=True))
        live = prep.live()
        if all_continue:
            done = []
        elif cont:
            done = [r for r, ok in zip(prep.batch, live, strict=True) if ok and id(r) not in cont]
        else:  # nothing continues (no overlap): no id() per request
            done = [r for r, ok in zip(prep.batch, live, strict=True) if ok]
        self._unbusy(done)  # those continuing in nxt stay busy there
        parked: list[Request] = []

        def leave_next(r: Request) -> None:
            """r will not continue in nxt: its row there is dropped, it is not busy."""
            if all_continue and not cont and rows_there:  # the first to leave: cont made now
                cont.update(zip(map(id, prep.batch), rows_there, strict=True))
                rows_there.clear()
            row = cont.pop(id(r), None)
            if row is not None and nxt is not None:
                nxt.dropped.add(row)
                self._unbusy([r])

        try:
            prep.commit(live)
            st.steps += 1
            kept = sum(live)
            if kept == len(live):
                st.small_tokens += prep.num_tokens
            else:
                decode = prep.num_tokens == len(live)  # a token a row: the live rows' count
                st.small_tokens += kept if decode else int(np.diff(prep.q_off)[live].sum())
                st.dropped_rows += len(live) - kept
            for r in self._partial(prep, live):  # a chunk short of its end: the next is due
                if r.finished_reason is not None:
                    continue
                if all_continue or id(r) in cont:  # it runs in nxt, unless aborted meanwhile
                    if not r.abort_requested:
                        continue
                    leave_next(r)
                self.running.append(r)
            batch, sel = prep.complete(out)
            rows = (~prep.incomplete).nonzero()[0].tolist()
            drawn = prep.drawn
            if drawn is None:  # run() rather than launch(): drawn here
                drawn = prep.drawn = draw(
                    out.logits, prep.batch, prep.kv_lens, prep.facts.sampled, out.greedy
                )
            decided = prep.decided
            if decided is None:
                index = prep.kv_lens[~prep.incomplete]
                toks = drawn.tokens[torch.as_tensor(rows, device=drawn.tokens.device)]
                decided = route(self.router, sel, batch, toks, index)
            answers = decided.resolve()
            tokens, failed = drawn.resolve(prep.batch)
            escalate = answers  # one answer per row unless a chunk stopped short
            if len(rows) < len(prep.batch):
                escalate = [False] * len(prep.batch)
                for k, i in enumerate(rows):
                    escalate[i] = answers[k]
            prep.resolved = np.asarray(tokens, dtype=np.int64)
        except BaseException as e:
            self.abandon(prep, e, live)
            if not isinstance(e, Exception):
                raise
            return []

        # The rows to finish: not a chunk short of its end, not dropped, not ended meanwhile.
        # Sorted out as arrays, then in three passes: the failed (their row could not be
        # sampled: each ends alone, with that), the parked (escalated: the small token is
        # discarded and never fed), and those that take their token, delivered under one
        # acquire of the delivery lock (this runs once per request per small step). As in
        # _each, a row that raises ends alone; an interrupt ends every row not yet handled.
        batch = prep.batch
        fail_rows: list[int] = []
        park_rows: list[int] = []
        takers: Sequence[Request] = batch
        taken = tokens
        if failed or any(escalate) or not all(live) or prep.any_incomplete:
            ok = np.asarray(live, dtype=np.bool_) & ~prep.incomplete
            esc = np.asarray(escalate, dtype=np.bool_)
            fail_rows = [i for i in failed if ok[i] and batch[i].finished_reason is None]
            ok[fail_rows] = False
            park_rows = (ok & esc).nonzero()[0].tolist()
            rows = (ok & ~esc).nonzero()[0].tolist()
            takers, taken = [batch[i] for i in rows], [tokens[i] for i in rows]
        shared = self.delivery_lock
        stage = k = count = 0  # the pass and its row reached, for an interrupt
        try:
            for k, i in enumerate(fail_rows):  # noqa: B007 (k: read on an interrupt)
                self.fail([batch[i]], failed[i])
                leave_next(batch[i])
            stage, k = 1, 0
            for k, i in enumerate(park_rows):  # noqa: B007 (k: read on an interrupt)
                r = batch[i]
                if r.finished_reason is not None:
                    continue
                try:
                    leave_next(r)
                    r.kv[SMALL].park(r.seq)
                    r.parked_at = now
                    parked.append(r)
                    st.escalations += 1
                except Exception as e:
                    self.fail([r], e)
                    leave_next(r)
            stage, k = 2, 0
            with shared:
                ends = end_reasons(takers, taken)  # before the tokens are appended
                for k, r in enumerate(takers):
                    if r.finished_reason is not None:
                        continue
                    try:
                        token = taken[k]
                        n = r.n
                        r.seq[n] = token
                        r.n = n + 1
                        count += 1
                        reason = ends[k]
                        if r.lock is shared:  # _deliver, inline
                            if not r.abort_requested:
                                r.tokens.append(token)
                                r.token_models.append(SMALL)
                                r.token_times.append(now)
                                r.ending = reason
                        else:  # a request made outside an engine keeps its own lock
                            with r.lock:
                                self._deliver(r, token, SMALL, now, reason)
                        self.touched.append(r)
                        if reason is not None or r.abort_requested:
                            self.finish(r, reason or "abort")
                            leave_next(r)
                        elif not all_continue and id(r) not in cont:
                            self.running.append(r)
                    except Exception as e:
                        self.fail([r], e)
                        leave_next(r)
        except BaseException as e:
            rest = [batch[i] for i in fail_rows[k:]] if stage == 0 else []
            rest += [batch[i] for i in park_rows[k if stage == 1 else 0 :]] if stage <= 1 else []
            rest += list(takers[k if stage == 2 else 0 :])
            self.fail(rest, e)
            raise
        finally:
            st.tokens += count
            self.parked += [r for r in parked if r.finished_reason is None]
        return parked

    def finish_large(self, prep: PreparedForward, out: ForwardOutput, now: float) -> list[Request]:
        """Commit the catch-up and each request's large token; returns those that go on. A
        request whose catch-up chunk stopped short stays parked (first in line) for the next
        catch-up: it rejoins the small model once its last chunk ran."""
        st = self.stats
        self._unbusy(prep.batch)
        try:
            prep.commit()
            self.parked[:0] = self._partial(prep)
            if prep.drawn is None:  # run() rather than launch(): drawn here
                prep.drawn = draw(
                    out.logits, prep.batch, prep.kv_lens, prep.facts.sampled, out.greedy
                )
            tokens, failed = prep.drawn.resolve(prep.batch)
        except BaseException as e:
            self.abandon(prep, e)
            if not isinstance(e, Exception):
                raise
            return []
        st.catchup_batch_sizes.append(len(prep.batch))
        st.catchup_tokens.append(prep.num_tokens)
        st.catchup_kv_tokens.append(int(prep.kv_lens.sum()))
        st.catchup_shared_prefix.append(prep.shared_prefix)
        back: list[Request] = []

        def step(i: int, r: Request) -> None:
            if prep.incomplete[i]:  # a chunk short of its end: parked for the next catch-up
                return
            if i in failed:
                raise failed[i]
            r.kv[LARGE].park(r.seq)
            if not self.commit_token(r, tokens[i], LARGE, now):
                back.append(r)

        try:
            self._each(prep.batch, step)
        except BaseException:
            self.running += back  # the driver never sees them: they step on from here
            raise
        return back

    def commit_token(self, r: Request, token: int, model: int, now: float) -> bool:
        """Appends a token and hands it to the caller; True when r finished (released)."""
        (reason,) = end_reasons((r,), (token,))  # before the token is appended
        n = r.n
        r.seq[n] = token
        r.n = n + 1
        st = self.stats
        st.tokens += 1
        if model == LARGE:
            st.large_tokens += 1
        with r.lock:
            self._deliver(r, token, model, now, reason)
        self.touched.append(r)
        if reason is not None or r.abort_requested:
            self.finish(r, reason or "abort")
            return True
        return False

    @staticmethod
    def _deliver(r: Request, token: int, model: int, now: float, reason: str | None) -> None:
        """Under r's lock: nothing is delivered after abort() returned; once its last token is
        (reason set), abort() is a no-op."""
        if not r.abort_requested:
            r.tokens.append(token)
            r.token_models.append(model)
            r.token_times.append(now)
            r.ending = reason

    def _partial(self, prep: PreparedForward, live: list[bool] | None = None) -> list[Request]:
        """The requests of a committed forward whose chunk stopped short of their last token
        (marked partial_prefill, the others unmarked): they go on at the next step. Only live
        rows (live: the caller's prep.live()): a row dropped from the forward (overlap: its
        request left it, aborted, before it finished) belongs to a request that is elsewhere
        by now, listed once already."""
        out: list[Request] = []
        short = None  # the live rows short of their end, when any row is
        if prep.any_incomplete:
            short = prep.incomplete if live is None else prep.incomplete & np.asarray(live)
        if short is None or not short.any():  # every chunk ran to its end: unmark, list none
            for i, r in enumerate(prep.batch):
                if r.partial_prefill and (live is None or live[i]):
                    r.partial_prefill = False
            return out
        for i, r in enumerate(prep.batch):
            if live is None or live[i]:
                r.partial_prefill = bool(short[i])
                if short[i]:
                    out.append(r)
        if out:
            st = self.stats
            st.prefill_chunks += len(out)
            if prep.side is self.sides[LARGE]:
                st.catchup_partial_rows += len(out)
                st.catchup_partial_kv_tokens += int(prep.kv_lens[short].sum())
        return out

    def abandon(
        self, prep: PreparedForward, error: BaseException, live: list[bool] | None = None
    ) -> None:
        """A forward, its commit or its routing raised: new slots not yet committed go back and
        the batch's live requests fail (released); rows dropped from it (overlap) belong to
        requests that left it before and are not touched."""
        live = prep.live() if live is None else live
        rows = [r for r, ok in zip(prep.batch, live, strict=True) if ok]
        self._unbusy(rows)
        prep.discard()
        prep.successor = None  # the rows continued there end here: it commits none of them
        if prep.after is not None and prep.after.successor is prep:
            prep.after.successor = None  # nothing of it continues here
        prep.after = None
        self.fail(rows, error)
