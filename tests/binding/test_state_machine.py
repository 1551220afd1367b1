"""Hypothesis state machine through the binding against a naive Python reference that keeps
every cached prefix in a dict. Invariants are checked after every step. Some steps misuse the
tree (a slot twice, a cursor twice, inserted_len past the tokens): they must raise their error
and change nothing, which the reference (unchanged too) then confirms."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

import tokencache as tc

TOKENS = st.lists(st.integers(0, 2), max_size=8)
TWO_OR_MORE = st.lists(st.integers(0, 2), min_size=2, max_size=8)
NAMESPACES = st.sampled_from([None, "salt"])
Prefix = tuple[str | None, tuple[int, ...]]


class TreeMachine(RuleBasedStateMachine):
    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        self.tree = tc.RadixTree()
        self.cached: dict[Prefix, int] = {}  # every cached prefix -> slot of its last token
        self.locks: dict[Prefix, int] = {}
        self.cursors: list[tuple[tc.Cursor, str | None, list[int]]] = []
        self.next_slot = 0
        self.live: set[int] = set()

    def slots(self, n: int) -> np.ndarray:
        out = np.arange(self.next_slot, self.next_slot + n, dtype=np.int64)
        self.next_slot += n
        return out

    def matched(self, ns: str | None, tokens: list[int]) -> list[int]:
        out = []
        for i in range(len(tokens)):
            slot = self.cached.get((ns, tuple(tokens[: i + 1])))
            if slot is None:
                break
            out.append(slot)
        return out

    def free(self, slots: np.ndarray) -> None:
        for s in slots.tolist():
            assert s in self.live, f"slot {s} returned twice"
            self.live.remove(s)

    def repeated_slot(self, data: st.DataObject, n: int) -> np.ndarray:
        """n fresh slots, one of them given twice."""
        slots = self.slots(n)
        i = data.draw(st.integers(0, n - 1))
        j = data.draw(st.integers(0, n - 1).filter(lambda j: j != i))
        slots[j] = slots[i]
        return slots

    def open_cursors(self) -> list[tuple[tc.Cursor, str | None, list[int]]]:
        return [c for c in self.cursors if not c[0].released]

    def pins(self) -> list[Prefix]:
        pins = [p for p, n in self.locks.items() if n > 0]
        pins += [(ns, tuple(t)) for c, ns, t in self.cursors if not c.released]
        return pins

    @rule(target=handles, ns=NAMESPACES, tokens=TOKENS)
    def insert(self, ns: str | None, tokens: list[int]) -> tuple[tc.Node, Prefix]:
        slots = self.slots(len(tokens))
        expect = len(self.matched(ns, tokens))
        r = self.tree.insert(np.array(tokens, dtype=np.int64), slots, ns)
        assert r.prefix_len == expect
        for i in range(expect, len(tokens)):
            self.cached[(ns, tuple(tokens[: i + 1]))] = int(slots[i])
            self.live.add(int(slots[i]))
        return r.node, (ns, tuple(tokens))

    @rule(ns=NAMESPACES, tokens=TWO_OR_MORE, data=st.data())
    def insert_a_slot_twice(self, ns: str | None, tokens: list[int], data: st.DataObject) -> None:
        slots = self.repeated_slot(data, len(tokens))
        before = self.tree.pretty_print()
        with pytest.raises(tc.DuplicateSlotError):
            self.tree.insert(np.array(tokens, dtype=np.int64), slots, ns)
        assert self.tree.pretty_print() == before

    @rule(ns=NAMESPACES, tokens=TOKENS, past=st.integers(1, 3))
    def insert_past_inserted_len(self, ns: str | None, tokens: list[int], past: int) -> None:
        before = self.tree.pretty_print()
        with pytest.raises(tc.InvalidArgumentError):
            self.tree.insert(tokens, self.slots(len(tokens)), ns, inserted_len=len(tokens) + past)
        assert self.tree.pretty_print() == before

    @rule(target=handles, ns=NAMESPACES, tokens=TOKENS)
    def match(self, ns: str | None, tokens: list[int]) -> tuple[tc.Node, Prefix]:
        expect = self.matched(ns, tokens)
        before = self.tree.pretty_print()  # the question first: the same length, read only
        assert self.tree.cached_prefix_len(tokens, ns) == len(expect)
        assert self.tree.pretty_print() == before
        m = self.tree.match_prefix(tokens, ns)
        assert m.length == len(expect) and m.slots.tolist() == expect
        return m.node, (ns, tuple(tokens[: m.length]))

    @rule(h=handles)
    def lock(self, h: tuple[tc.Node, Prefix]) -> None:
        node, prefix = h
        if node.is_alive():
            self.tree.lock(node)
            self.locks[prefix] = self.locks.get(prefix, 0) + 1
        else:
            try:
                self.tree.lock(node)
            except tc.StaleHandleError:
                return
            raise AssertionError("locked a dead node")

    @rule(h=handles)
    def unlock(self, h: tuple[tc.Node, Prefix]) -> None:
        node, prefix = h
        if self.locks.get(prefix, 0) > 0 and node.is_alive():
            self.tree.unlock(node)
            self.locks[prefix] -= 1

    @rule(n=st.integers(0, 6))
    def evict(self, n: int) -> None:
        evictable = self.tree.evictable_size()
        freed = self.tree.evict(n)
        assert len(freed) >= min(n, evictable)
        self.free(freed)
        gone = set(freed.tolist())
        self.cached = {p: s for p, s in self.cached.items() if s not in gone}

    @rule(ns=NAMESPACES)
    def new_cursor(self, ns: str | None) -> None:
        self.cursors.append((self.tree.cursor(ns), ns, []))

    @precondition(lambda self: any(not c.released for c, _, _ in self.cursors))
    @rule(data=st.data(), tokens=TOKENS)
    def extend(self, data: st.DataObject, tokens: list[int]) -> None:
        cur, ns, seq = data.draw(st.sampled_from(self.open_cursors()))
        slots = self.slots(len(tokens))
        self.live.update(slots.tolist())
        d = cur.extend(np.array(tokens, dtype=np.int64), slots)
        freed = [] if d is None else d.freed.tolist()
        want = []
        for i, (t, s) in enumerate(zip(tokens, slots.tolist(), strict=True)):
            key = (ns, (*seq, *tokens[: i + 1]))
            if key in self.cached:
                if self.cached[key] != s:
                    want.append(s)
            else:
                self.cached[key] = s
            del t
        assert freed == want
        if d is not None:
            self.free(d.freed)
        seq.extend(tokens)

    @precondition(lambda self: any(not c.released for c, _, _ in self.cursors))
    @rule(data=st.data(), tokens=TWO_OR_MORE)
    def extend_a_slot_twice(self, data: st.DataObject, tokens: list[int]) -> None:
        cur, _, seq = data.draw(st.sampled_from(self.open_cursors()))
        before = self.tree.pretty_print()
        with pytest.raises(tc.DuplicateSlotError):
            cur.extend(tokens, self.repeated_slot(data, len(tokens)))
        assert self.tree.pretty_print() == before and cur.length == len(seq)

    @precondition(lambda self: any(not c.released for c, _, _ in self.cursors))
    @rule(data=st.data(), a=TOKENS, b=TOKENS)
    def extend_many_misused(self, data: st.DataObject, a: list[int], b: list[int]) -> None:
        """The same cursor twice, or one slot for two requests: refused, nothing moves."""
        first = data.draw(st.sampled_from(self.open_cursors()))
        second = data.draw(st.sampled_from(self.open_cursors()))
        tokens = a + b
        if first[0] is second[0]:
            error: type[Exception] = tc.DuplicateCursorError
            slots = self.slots(len(tokens))
        elif a and b:
            error = tc.DuplicateSlotError
            slots = self.slots(len(tokens))
            slots[len(a) + data.draw(st.integers(0, len(b) - 1))] = slots[0]
        else:
            return
        before = self.tree.pretty_print()
        with pytest.raises(error):
            self.tree.extend_many([first[0], second[0]], [0, len(a), len(tokens)], tokens, slots)
        assert self.tree.pretty_print() == before
        assert (first[0].length, second[0].length) == (len(first[2]), len(second[2]))

    @precondition(lambda self: any(not c.released for c, _, _ in self.cursors))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        cur, _, _ = data.draw(st.sampled_from(self.open_cursors()))
        assert cur.release().size == 0

    @invariant()
    def consistent(self) -> None:
        self.tree.check_invariants()
        assert self.tree.total_size() == len(self.cached)
        pins = self.pins()
        protected = sum(
            1 for ns, p in self.cached if any(pns == ns and q[: len(p)] == p for pns, q in pins)
        )
        assert self.tree.protected_size() == protected
        assert sorted(self.tree.all_slots().tolist()) == sorted(self.cached.values())

    def teardown(self) -> None:
        for cur, _, _ in self.cursors:
            if not cur.released:
                cur.release()
        for (ns, p), n in self.locks.items():
            node = self.tree.match_prefix(list(p), ns).node
            for _ in range(n):
                self.tree.unlock(node)
        self.free(self.tree.evict(self.tree.total_size()))
        assert not self.live, "slots leaked"


TreeMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestTreeMachine = TreeMachine.TestCase
