"""Generation's parts on their own, without an engine or a server: the error's default status,
Timing's per-token mean, LoopWaker's one loop hop per burst, and where a request's output is
decoded (a fake engine handle stands in for the routing engine's)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tokencache_serve.generation import Generation, GenerationError, LoopWaker, Timing


class FakeHandle:
    """The parts of RequestHandle that Generation reads; the test plays the driver thread."""

    rid = 7

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.models: list[int] = []
        self.finished_reason: str | None = None
        self.error: BaseException | None = None
        self.listeners: list[Any] = []

    def add_listener(self, fn: Any) -> None:
        self.listeners.append(fn)

    def done(self) -> bool:
        return self.finished_reason is not None

    def abort(self) -> bool:
        if self.done():
            return False
        self.finished_reason = "abort"
        return True

    def deliver(self, tokens: list[int], reason: str | None = None) -> None:
        self.tokens += tokens
        self.models += [0] * len(tokens)
        self.finished_reason = reason
        for fn in self.listeners:
            fn(self)


class FakeEngine:
    def __init__(self) -> None:
        self.handle = FakeHandle()

    def submit(self, prompt: list[int], max_tokens: int, sampling: Any = None) -> FakeHandle:
        return self.handle


class ThreadRecordingTokenizer:
    """One character per token id; records the thread of every decode."""

    def __init__(self) -> None:
        self.threads: set[str] = set()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.threads.add(threading.current_thread().name)
        return "".join(chr(ord("a") + i) for i in ids)


def test_a_generation_error_is_a_500_unless_said_otherwise() -> None:
    # the server answers its own failure while answering with GenerationError(message) alone
    e = GenerationError("Internal server error.")
    assert (e.status, e.code, e.message) == (500, None, "Internal server error.")


def test_per_token_is_the_mean_gap_after_the_first_token() -> None:
    t = Timing(arrival=10.0, first_token=11.0, last_token=11.5)
    assert t.ttft == 1.0
    assert t.per_token(2) == 0.5  # one gap
    assert t.per_token(6) == 0.1  # five gaps
    assert t.per_token(1) is None  # no gap yet
    assert Timing(arrival=10.0).per_token(5) is None and Timing(arrival=10.0).ttft is None


class CountingLoop:
    """call_soon_threadsafe recorded, run later by the test (the event loop's turn)."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def call_soon_threadsafe(self, fn: Any) -> None:
        self.calls.append(fn)


def test_a_burst_of_wakes_costs_one_loop_hop() -> None:
    loop = CountingLoop()
    waker = LoopWaker(loop)  # type: ignore[arg-type]
    events = [asyncio.Event() for _ in range(32)]
    for e in events:  # one driver step delivering tokens to 32 requests
        waker.wake(e)
    assert len(loop.calls) == 1
    loop.calls.pop()()  # the loop drains: every request woken
    assert all(e.is_set() for e in events)
    waker.wake(events[0])  # the next burst gets its own hop
    assert len(loop.calls) == 1


def test_arrival_defaults_to_construction_time() -> None:
    before = time.perf_counter()
    g = Generation(FakeEngine(), ThreadRecordingTokenizer(), [1, 2], 4, None, (), None)  # type: ignore[arg-type]
    assert before <= g.timing.arrival <= time.perf_counter()
    g2 = Generation(FakeEngine(), ThreadRecordingTokenizer(), [1], 4, None, (), None, 3.5)  # type: ignore[arg-type]
    assert g2.timing.arrival == 3.5


def test_output_is_decoded_in_the_pool_not_on_the_event_loop() -> None:
    tok = ThreadRecordingTokenizer()

    async def main() -> list[str]:
        engine = FakeEngine()
        with ThreadPoolExecutor(1, thread_name_prefix="decode-pool") as pool:
            waker = LoopWaker(asyncio.get_running_loop())
            g = Generation(engine, tok, [1], 3, None, (), waker, pool=pool)  # type: ignore[arg-type]
            engine.handle.deliver([0, 1])
            engine.handle.deliver([2], "length")
            return [c.text async for c in g.chunks()]

    assert "".join(asyncio.run(main())) == "abc"
    assert tok.threads and all(name.startswith("decode-pool") for name in tok.threads)
