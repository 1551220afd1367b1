"""Generation's parts on their own, without an engine or a server: the error's default status,
Timing's per-token mean, LoopWaker's one loop hop per burst, and where a request's output is
decoded (a fake engine handle stands in for the routing engine's)."""

from __future__ import annotations

import asyncio
import logging
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

    def deliver(
        self, tokens: list[int], reason: str | None = None, models: list[int] | None = None
    ) -> None:
        self.tokens += tokens
        self.models += [0] * len(tokens) if models is None else models
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


class LetterTokenizer:
    """Token i is the letter chr(ord('a') + i); fails on `poison` if given."""

    def __init__(self, poison: int | None = None) -> None:
        self.poison = poison

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.poison in ids:
            raise RuntimeError("planted decode failure")
        return "".join(chr(ord("a") + i) for i in ids)


Step = tuple[list[int], str | None, list[int] | None]  # tokens, finish reason, models


def run_steps(g: Generation, h: FakeHandle, steps: list[Step]) -> Any:
    """Delivers each step after the previous one's chunk was read; returns (chunks, error)."""

    async def main() -> tuple[list[Any], GenerationError | None]:
        g._waker = LoopWaker(asyncio.get_running_loop())
        it = g.chunks().__aiter__()
        out: list[Any] = []
        try:
            for tokens, reason, models in steps:
                h.deliver(tokens, reason, models)
                out.append(await it.__anext__())
            async for c in it:  # what the last step still yields
                out.append(c)
        except GenerationError as e:
            return out, e
        return out, None

    return asyncio.run(main())


def make(stops: tuple[str, ...] = (), tok: Any = None) -> tuple[Generation, FakeHandle]:
    engine = FakeEngine()
    g = Generation(engine, tok or LetterTokenizer(), [1, 2], 8, None, stops, None, 0.0)  # type: ignore[arg-type]
    return g, engine.handle


def test_text_held_back_for_a_stop_string_is_sent_when_the_request_ends() -> None:
    g, h = make(("cd",))
    chunks, err = run_steps(g, h, [([0, 2], None, None), ([], "length", None)])
    assert err is None
    assert [c.text for c in chunks] == ["a", "c"]  # "c" may begin "cd": held until the end
    assert chunks[-1].finish_reason == "length" and g.text == "ac"


def test_tokens_models_and_times_accumulate_over_steps() -> None:
    g, h = make()
    before = time.perf_counter()
    chunks, err = run_steps(g, h, [([0, 1], None, [1, 0]), ([2], "length", [1])])
    assert err is None and [c.models for c in chunks] == [[1, 0], [1]]
    assert g.tokens == [0, 1, 2] and g.models == [1, 0, 1] and g.num_large == 2
    t = g.timing
    assert t.first_token is not None and t.last_token is not None
    assert before <= t.first_token <= t.last_token <= time.perf_counter()
    assert g.finish_reason == "length"


def test_a_decoding_failure_ends_the_request_with_a_500(caplog: Any) -> None:
    caplog.set_level(logging.ERROR, logger="tokencache_serve")
    g, h = make(tok=LetterTokenizer(poison=3))
    chunks, err = run_steps(g, h, [([0], None, None), ([3], None, None)])
    assert [c.text for c in chunks] == ["a"]
    assert isinstance(err, GenerationError)
    assert (err.status, err.code) == (500, None)
    assert err.message == "The server failed to decode this request's output."
    assert g.finish_reason == "error" and h.finished_reason == "abort"  # aborted in the engine
    (rec,) = [r for r in caplog.records if r.name == "tokencache_serve"]
    assert rec.getMessage() == "rid=7: decoding its output failed; ending this request"
    assert rec.exc_info is not None and "planted" in str(rec.exc_info[1])


def test_an_engine_failure_is_a_500_logged_with_its_error(caplog: Any) -> None:
    caplog.set_level(logging.ERROR, logger="tokencache_serve")
    g, h = make()
    h.error = RuntimeError("the device fell over")
    chunks, err = run_steps(g, h, [([0], None, None), ([], "error", None)])
    assert [c.text for c in chunks] == ["a"]
    assert isinstance(err, GenerationError) and (err.status, err.code) == (500, None)
    assert err.message == "The engine failed this request."
    assert g.finish_reason == "error"
    (rec,) = [r for r in caplog.records if r.name == "tokencache_serve"]
    assert "rid=7" in rec.getMessage() and "the device fell over" in rec.getMessage()


def test_an_abort_at_shutdown_sends_what_was_made_then_a_503() -> None:
    g, h = make(("cd",))
    chunks, err = run_steps(g, h, [([0], None, None), ([2, 1], "abort", [1, 0])])
    assert [c.text for c in chunks] == ["a", "cb"]  # what was made before the abort
    assert chunks[-1].token_ids == [2, 1] and chunks[-1].models == [1, 0]
    assert chunks[-1].finish_reason is None
    assert isinstance(err, GenerationError)
    assert (err.status, err.code) == (503, "server_shutting_down")
    assert err.message == (
        "The request was aborted before it finished: the server is shutting down. Retry it."
    )
    assert g.finish_reason == "abort"


def test_an_abort_after_held_back_text_still_sends_that_text() -> None:
    g, h = make(("cd",))
    chunks, err = run_steps(g, h, [([0, 2], None, None), ([], "abort", None)])
    assert [c.text for c in chunks] == ["a", "c"] and chunks[-1].token_ids == []
    assert isinstance(err, GenerationError) and err.status == 503


def test_abort_says_whether_it_stopped_a_running_request() -> None:
    # what the server's abort_all counts at shutdown: the requests that were still running
    g, h = make()
    assert g.abort() is True and h.finished_reason == "abort"
    assert g.abort() is False  # already ended
    g2, h2 = make()
    h2.finished_reason = "length"
    assert g2.abort() is False and h2.finished_reason == "length"
