"""The engine's host path per step is O(batch + new tokens), whatever the context, and the
engine clock charges the host time it measures as the host_charge says (no timing asserted:
sizes and schedules are counted, and clock time is compared only as an ordering)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from routing_helpers import make_prompts

import tokencache_models.forward.context as context
from tokencache_routing import EngineConfig, EntropyRouter, RoutedEngine, SchedulerConfig
from tokencache_routing.sim.clock import GpuClock


def _host_path() -> Any:
    """benches/host_path.py, imported from its folder (it is a script, not a package)."""
    benches = str(Path(__file__).resolve().parents[2] / "benches")
    if benches not in sys.path:
        sys.path.insert(0, benches)
    import host_path

    return host_path


def _moved_per_decode_step(pair: Any, prompt_len: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """The most int64 entries one decode step copies to the model's device (4 requests)."""
    moved: list[int] = []
    to_device = context.to_device

    def counting(arrays: Any, device: Any) -> Any:
        moved.append(sum(int(a.size) for a in arrays))
        return to_device(arrays, device)

    monkeypatch.setattr(context, "to_device", counting)
    prompts = make_prompts(4, seed=3, shared=prompt_len - 8, lo=8, hi=8)
    eng = RoutedEngine(
        *pair, EntropyRouter(math.inf), config=EngineConfig(num_slots=4 * prompt_len + 512)
    )
    handles = [eng.submit(p, 12) for p in prompts]
    while any(len(h.tokens) < 2 for h in handles):
        eng.iterate()
    moved.clear()
    for _ in range(6):
        eng.iterate()
    assert eng.idle_invariant() is False  # still decoding: rows held
    eng.shutdown()
    assert eng.idle_invariant()
    return max(moved)


def test_a_decode_step_copies_nothing_per_context_token(
    pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the slot table, each step concatenated every request's whole slot row (and the
    runner copied it again): 4 x 480 entries at a 480-token context. Now a step moves its
    O(batch) metadata only, the same at 40 and at 480 tokens of context (with overlap, two
    more entries a row: where its deferred token comes from and goes, DeferredTokens)."""
    short = _moved_per_decode_step(pair, 40, monkeypatch)
    long = _moved_per_decode_step(pair, 480, monkeypatch)
    assert long == short <= 10 * 4 + 1


def _engine(pair: Any, charge: str, clock: Any, overlap: bool = False) -> RoutedEngine:
    return RoutedEngine(
        *pair,
        EntropyRouter(math.inf),
        config=EngineConfig(
            num_slots=2048,
            scheduler=SchedulerConfig(max_running=4),
            clock=clock,
            host_charge=charge,
            overlap=overlap,
        ),
    )


def test_host_time_is_charged_as_host_charge_says(pair: Any) -> None:
    """serial: every step costs its device price plus its measured host time, which holds the
    tree time; trees: only the tree calls; overlap: max(host, device) per step. The step clock
    charges none of it (a pure function of the schedule, equal whatever the charge)."""
    prompts = make_prompts(4, seed=5, shared=20)
    clocks: dict[str, float] = {}
    for charge in ("serial", "trees", "overlap"):
        eng = _engine(pair, charge, GpuClock(profile="h200-roofline"))
        eng.generate(prompts, 8)
        st = eng.stats
        assert st.host_s >= st.small_host_s > 0 and st.small_device_s > 0
        assert st.host_s >= st.bookkeeping_s
        clocks[charge] = st.modeled_s
        device = st.small_device_s
        # Each run against its own measured times (two runs' host times differ under load).
        serial_charge = device + st.small_host_s
        if charge == "serial":  # equal sums in another order: a last bit apart (seen: 1 ulp)
            assert st.modeled_s >= serial_charge * (1 - 1e-12)
        if charge == "trees":
            assert st.modeled_s < serial_charge
        if charge == "overlap":
            assert max(device, st.small_host_s) <= st.modeled_s < serial_charge
    steps = {c: _engine(pair, c, "steps").generate(prompts, 8).stats.modeled_s for c in clocks}
    assert len(set(steps.values())) == 1
    with pytest.raises(ValueError, match="host_charge"):
        _engine(pair, "none", "steps")


def test_rows_are_returned_whatever_ends_a_request(pair: Any) -> None:
    """Every way out (finishing, aborting, a preemption under a small pool) gives the request's
    slot-table rows back: idle_invariant checks rows_held == 0 on both models."""
    prompts = make_prompts(6, seed=8, shared=6, lo=4, hi=8)
    eng = RoutedEngine(
        *pair, EntropyRouter(1.0), config=EngineConfig(num_slots=48)
    )  # tight: preemptions
    hs = [eng.submit(p, 14) for p in prompts]
    hs[2].abort()
    for h in hs:
        h.wait()
    assert eng.stats.preemptions > 0
    assert all(side.table.rows_held == 0 for side in eng.sides) and eng.idle_invariant()
    assert np.all(~eng.small.table._held)


def test_models_whose_vocabularies_differ_in_size_route_over_the_shared_ids(pair: Any) -> None:
    """Checkpoints of one family pad their embedding tables differently (R1-Distill-Qwen-1.5B:
    151,936 rows, -32B: 152,064): the engine routes over the ids both have and matches the
    no-cache reference, which drops the extra logits the same way. Every token is below the
    smaller vocabulary (the large model's extra rows are biased to win if they were drawn)."""
    import dataclasses

    import torch

    from tokencache_models import random_model
    from tokencache_routing import BernoulliRouter, SamplingParams, reference_generate

    small, large = pair
    cfg = dataclasses.replace(large.config, vocab_size=large.config.vocab_size + 32)
    wide = random_model(cfg, seed=2, std=0.3)
    with torch.no_grad():
        wide.lm_head.weight[small.config.vocab_size :] = 5.0  # would win every argmax
    router = BernoulliRouter(0.5, seed=3)
    prompts = make_prompts(4, seed=4, shared=4)
    eng = RoutedEngine(small, wide, router, config=EngineConfig(num_slots=512))
    # Three greedy requests (their argmax in the forward's epilogue) and one that samples
    # from the logits themselves, which must be the shared ids' too.
    sampling = [None, None, None, SamplingParams(temperature=1.5, seed=5)]
    handles = [eng.submit(p, 8, sampling=sampling[i]) for i, p in enumerate(prompts)]
    assert all(h.wait(60) for h in handles)
    tokens, models = [h.tokens for h in handles], [h.models for h in handles]
    ref, _ = reference_generate(small, wide, prompts[:3], 8, lambda i, p: bool(models[i][p]))
    assert tokens[:3] == ref and any(any(m) for m in models)
    assert any(models[3]) and len(tokens[3]) == 8  # the sampled request reached the large model
    assert max(max(t) for t in tokens) < small.config.vocab_size == eng.vocab_size


def test_kv_events_are_recorded_when_asked(pair: Any) -> None:
    """EngineConfig(kv_events=True): both trees record the pages they store (what a KV-event
    publisher drains with take_events); without it they record nothing."""
    prompts = make_prompts(2, seed=6, shared=8)
    on = RoutedEngine(
        *pair, EntropyRouter(math.inf), config=EngineConfig(num_slots=512, kv_events=True)
    )
    on.generate(prompts, 4)
    stored = [e for e in on.small.tree.take_events() if e.kind == "stored"]
    assert stored and on.kv_events
    off = RoutedEngine(*pair, EntropyRouter(math.inf), config=EngineConfig(num_slots=512))
    off.generate(prompts, 4)
    assert off.small.tree.take_events() == []


@pytest.mark.parametrize("overlap,per_row", [(True, 6), (False, 14)])
def test_a_decode_step_makes_few_python_calls_per_row(overlap: bool, per_row: int) -> None:
    """Python stays off the per-request path of a decode step: the calls a step makes (counted
    by cProfile, benches/host_path.py --calls; a count, not a time) grow by at most `per_row`
    a request from 8 to 64 requests (measured: 5 with overlap, the default: a continued row
    is selected, planned, committed and delivered as arrays; 8 before steady decoding went
    on in place; 11 without, the serial path of the
    threaded driver, 25 before its per-request reads were mapped in C). A per-row helper
    call or generator added to the step shows here."""
    host_path = _host_path()

    few = host_path.calls_per_step(8, 512, "gpu", 10, overlap)
    many = host_path.calls_per_step(64, 512, "gpu", 10, overlap)
    assert 0 < (many - few) / 56 <= per_row


def test_steady_overlapped_decoding_goes_on_in_place() -> None:
    """A step whose rows all continue the step before in their places takes that step's rows,
    facts and drawn tokens as they are (DeferredTokens.in_place: one device copy, no index);
    the step after a row left (a request that ends first) goes through the per-row
    selection, and the steps after it are in place again. (Exactness with overlap on is the
    other tests'; this one says the steady path is the one taken.)"""
    host_path = _host_path()

    eng = host_path._engine(4, 512, "gpu", EntropyRouter(float("inf")), 12)
    prompts = host_path._prompts(4, 512)
    handles = [
        eng.submit(p, max_new_tokens=m) for p, m in zip(prompts, (6, 12, 12, 12), strict=True)
    ]
    seen: list[tuple[int, bool]] = []
    while not all(h.done() for h in handles):
        eng.iterate()
        pending = eng._events.pending
        deferred = pending.prep.host.deferred if pending is not None else None
        if deferred is not None:
            seen.append((len(pending.prep.batch), deferred.in_place))
            if deferred.in_place:
                prep, after = pending.prep, pending.prep.after
                assert after is not None
                assert prep.facts is after.facts and prep.host.rows is after.host.rows
                assert prep.host.kv_starts is after.host.kv_starts
                if after.num_tokens == len(after.batch):  # a decode step before: its offsets
                    assert prep.q_off is after.q_off
                    assert prep.host.candidate_groups() == after.host.candidate_groups()
    kept = eng.sched.sides[0].table.groups_kept  # steps given the step before's groups
    eng.shutdown()
    assert (4, True) in seen
    after_leaving = seen.index((3, False))  # the first step without the ended request
    assert (3, True) in seen[after_leaving:]
    assert [len(h.tokens) for h in handles] == [6, 12, 12, 12]
    assert kept > 0


def test_the_decode_runners_are_made_with_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose decode steps take a graph runner (on a GPU; here the stub's GPU host
    path) has it made when the engine is built, as a server makes it at startup: no step
    pays for its buffers (the first decode step did, ~17 ms of host on this CPU, on the
    honest clock), and every decode step then goes through it."""
    import tokencache_models.executor.model_executor as executor
    import tokencache_models.testing.stubbed_device as stub
    from tokencache_models import random_model

    made: list[executor.DecodeGraphRunner] = []

    class Counted(executor.DecodeGraphRunner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(executor, "DecodeGraphRunner", Counted)
    host_path = _host_path()

    models = [stub.stub_execute(random_model(host_path.CONFIG, seed=s), "gpu") for s in (1, 2)]
    eng = RoutedEngine(*models, EntropyRouter(math.inf), config=EngineConfig(num_slots=4096))
    assert len(made) == 2  # one a model, over its side's pool
    assert {id(r.pool) for r in made} == {id(eng.small.pool), id(eng.large.pool)}
    replayed = []
    run = Counted.prepare

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        replayed.append(self)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(Counted, "prepare", counting)
    eng.generate(host_path._prompts(4, 256), 6)
    assert len(made) == 2 and replayed and all(r is made[0] for r in replayed)


def test_the_phase_timer_times_every_phase_and_unwraps_them() -> None:
    """benches/host_path.py --phases: every phase it names runs in a steady decode step and is
    timed; afterwards the engine's functions are the originals again (this test process
    goes on using them)."""
    import importlib

    host_path = _host_path()

    def current(module: str, name: str) -> Any:
        owner: Any = importlib.import_module(module)
        for part in name.split("."):
            owner = getattr(owner, part)
        return owner

    before = [current(m, n) for _, m, n in host_path.PHASES]
    host, spent = host_path.phases_per_step(4, 256, "gpu", 12, True)
    assert host > 0 and set(spent) == {label for label, _, _ in host_path.PHASES}
    assert all(ms > 0 for ms in spent.values()), spent
    assert [current(m, n) for _, m, n in host_path.PHASES] == before


def test_the_bench_times_escalating_decoding_too(capsys: pytest.CaptureFixture[str]) -> None:
    """benches/host_path.py --escalate: beside the steady rows, decoding under a router that
    escalates a share of the tokens: every small step timed while rows leave for catch-ups
    and rejoin (fewer rows than the batch on average), labelled in the table."""
    host_path = _host_path()

    args = ["--batches", "8", "--contexts", "256", "--overlap", "on", "--steps", "40"]
    steady, routed = host_path.main([*args, "--catchup-rounds", "0", "--escalate", "0", "0.2"])
    assert (steady.escalate, steady.mean_rows) == (0.0, None)
    assert routed.escalate == 0.2 and routed.mean_rows is not None
    assert 0 < routed.mean_rows < 8  # rows were away at catch-ups
    assert routed.host_ms > 0 and routed.device_ms > 0
    assert "| decode, p=0.2 (" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        host_path.main([*args, "--escalate", "1"])
