"""Once every request has returned, the engine is idle: nothing pinned, every slot free or
cached, whatever the device does meanwhile.

On a GPU the threaded driver's two workers share one device. Under the measured clock each
forward and each tree call is synchronised for timing (ModelSide.sync); a worker that
synchronises the whole device while the other captures a CUDA graph (a shape's first use)
gets "operation not permitted when stream is capturing" and the capture is invalidated. A
timing sync that raised around a tree call skipped the bookkeeping after it (a release's row
and tail, a pin): the engine was left not idle once every request had returned, the likely
cause of benches/gpu/routing_step.py's threaded failure on an H200. The CPU runs no sync at
all, so these stubs stand in for the device: a sync that fails, a sync and a read-back that
complete late."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from routing_helpers import bernoulli_decide, check_exact, make_prompts, no_worker_threads

from tokencache_routing import (
    BernoulliRouter,
    EngineConfig,
    RoutedEngine,
    SchedulerConfig,
    reference_generate,
)
from tokencache_routing.core import kv as kv_module
from tokencache_routing.core import sampling as sampling_module
from tokencache_routing.core.kv import ModelSide

MODES = ["events", "threaded"]
WAIT_S = 30.0  # a handle that has not returned by then is a hang: the test fails


class CapturingDevice:
    """A side's sync() as CUDA answers it while the other worker captures a graph: every
    `every`-th call raises (calls counted across both sides, from any thread)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.calls = self.failed = 0
        self.lock = threading.Lock()
        self.error = RuntimeError("CUDA error: operation not permitted when stream is capturing")

    def sync(self) -> None:
        with self.lock:
            self.calls += 1
            fail = self.calls % self.every == 0
            self.failed += fail
        if fail:
            raise self.error


def wait_all(handles: list[Any]) -> None:
    for h in handles:
        assert h.wait(WAIT_S), f"request {h.rid} never returned"


def stuck(eng: RoutedEngine) -> dict[str, int]:
    """What is left when the engine is not idle (for the assertion's message)."""
    m = eng.metrics()
    return {
        k: int(v) for k, v in m.items() if k.endswith(("_used", "_cached", "_pinned", "_running"))
    }


def finish_idle(eng: RoutedEngine) -> None:
    """Right after the last handle returned (no join, no drain): idle, the threads leave."""
    assert eng.idle_invariant(), stuck(eng)
    eng.shutdown()
    assert no_worker_threads()


@pytest.fixture
def threads_stopped() -> Iterator[None]:
    """A test that failed half-way leaves no worker behind for the next one (they stop when
    idle)."""
    yield
    deadline = time.monotonic() + 10.0
    while not no_worker_threads() and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("every", [3, 7])
def test_failing_timing_syncs_leave_nothing_behind(
    pair: Any, mode: str, every: int, threads_stopped: None
) -> None:
    """Syncs that fail as CUDA's do during another thread's capture: a failed forward ends its
    requests with that error, a tree call's timing is lost, and once every request has
    returned nothing is pinned or unfreed; the next generate on a sound device is exact."""
    router = BernoulliRouter(0.3, seed=every)
    sched = SchedulerConfig(max_running=4, min_large_batch=2, max_wait_s=0.002)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=512, scheduler=sched, mode=mode)
    )
    device = CapturingDevice(every)
    for side in eng.sides:
        side.sync = device.sync  # type: ignore[method-assign]
    prompts = make_prompts(8, seed=90 + every, shared=6)
    handles = [eng.submit(p, 8, route_key=i) for i, p in enumerate(prompts)]
    wait_all(handles)
    assert device.failed > 0
    assert eng.idle_invariant(), stuck(eng)
    ref, _ = reference_generate(*pair, prompts, 8, bernoulli_decide(router))
    for h, want in zip(handles, ref, strict=True):
        assert h.finished_reason in ("length", "error")
        if h.finished_reason == "error":  # only a failed forward fails a request
            assert h.error is device.error
            assert h.tokens == want[: len(h.tokens)]
        else:
            assert h.tokens == want
    for side in eng.sides:
        del side.sync  # the class's again: a sound device
    check_exact(eng, pair, router)  # generate joined the driver: no thread left either


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_a_failing_sync_around_a_release_still_releases(
    pair: Any, mode: str, monkeypatch: pytest.MonkeyPatch, threads_stopped: None
) -> None:
    """Only the timing syncs around a finished request's release fail: the release happens in
    full (row, tail, pin) and the request ends as it would have ("length"), not "error" with
    its KV left behind."""
    releasing = threading.local()
    real = kv_module.CursorKV.release

    def release(self: kv_module.CursorKV, seq: Any) -> None:
        releasing.on = True
        try:
            real(self, seq)
        finally:
            releasing.on = False

    def sync() -> None:
        if getattr(releasing, "on", False):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(kv_module.CursorKV, "release", release)
    router = BernoulliRouter(0.3, seed=5)
    eng = RoutedEngine(*pair, router, config=EngineConfig(num_slots=512, mode=mode))
    for side in eng.sides:
        side.sync = sync  # type: ignore[method-assign]
    prompts = make_prompts(5, seed=95, shared=4)
    handles = [eng.submit(p, 6, route_key=i) for i, p in enumerate(prompts)]
    wait_all(handles)
    assert eng.idle_invariant(), stuck(eng)
    assert [h.finished_reason for h in handles] == ["length"] * len(handles)
    ref, _ = reference_generate(*pair, prompts, 6, bernoulli_decide(router))
    assert [h.tokens for h in handles] == ref
    finish_idle(eng)


class _Stream:
    def __init__(self, log: list[Any], device: Any) -> None:
        self.log, self.device = log, device

    def synchronize(self) -> None:
        self.log.append(("stream", self.device))


def test_a_side_waits_for_its_own_stream_never_the_whole_device(
    pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The measured clock's sync waits for the calling thread's stream on the model's device:
    a device-wide synchronize would wait for the other worker's forwards and break a graph
    capture running there."""
    log: list[Any] = []

    def device_wide(device: Any = None) -> None:
        raise AssertionError("torch.cuda.synchronize: the whole device, the other worker's too")

    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(log, device))
    side = ModelSide("small", pair[0], pair[0].make_kv_pool(64))
    side.sync_cuda = True
    side.sync()
    with side.bookkeeping("match"):
        pass
    assert log == [("stream", pair[0].device)] * 3


def late(delay_s: float, real: Callable[..., Any]) -> Callable[..., Any]:
    def call(*a: Any, **k: Any) -> Any:
        time.sleep(delay_s)
        return real(*a, **k)

    return call


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_idle_when_read_backs_and_syncs_complete_late(
    pair: Any, mode: str, monkeypatch: pytest.MonkeyPatch, threads_stopped: None
) -> None:
    """A device whose work completes late (each read-back and sync waits), as CUDA's: the
    last token is delivered, the handles return, and the engine is idle at once."""
    monkeypatch.setattr(sampling_module.Readback, "get", late(0.002, sampling_module.Readback.get))
    router = BernoulliRouter(0.3, seed=6)
    sched = SchedulerConfig(max_running=4, min_large_batch=2, max_wait_s=0.002)
    eng = RoutedEngine(
        *pair, router, config=EngineConfig(num_slots=512, scheduler=sched, mode=mode)
    )
    for side in eng.sides:
        side.sync = late(0.001, lambda: None)  # type: ignore[method-assign]
    prompts = make_prompts(8, seed=97, shared=6)
    handles = [eng.submit(p, 8, route_key=i) for i, p in enumerate(prompts)]
    wait_all(handles)
    assert eng.idle_invariant(), stuck(eng)
    ref, _ = reference_generate(*pair, prompts, 8, bernoulli_decide(router))
    assert [h.tokens for h in handles] == ref
    finish_idle(eng)
