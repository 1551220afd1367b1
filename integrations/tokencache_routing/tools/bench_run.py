"""Running the routing benchmark: every job of a command line (measure), one system on one
workload point (run: its engine built, warmed up, primed, then timed), and the warm-up pass."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from .bench_prompts import longest_common_prefix, make_prompts, system_prompts_of
from .bench_rows import BOUNDS, Row
from .bench_workloads import StepTrace, Workload, arrival_times

if TYPE_CHECKING:
    from ..config import Dispatch, Mode


def measure(a: argparse.Namespace, out: Path) -> tuple[list[Row], dict[str, Any]]:
    """Runs every job of the command line; bench.json is rewritten after every row."""
    from tokencache_extras import require_or_exit

    require_or_exit("torch", "tokencache_models", extra="routing", prog="tokencache_routing bench")
    import torch

    from ..sim.clock import DEFAULT_PROFILE

    a.profile = a.profile or DEFAULT_PROFILE  # here, not at parsing: --help needs no torch

    if "naive-sglang" in a.dispatches:
        try:
            from ..baselines.naive_sglang import sglang_api

            sglang_api()
        except ImportError as e:
            print(f"naive-sglang skipped: {e}".splitlines()[0], file=sys.stderr)
            a.dispatches = [d for d in a.dispatches if d != "naive-sglang"]
    torch.set_num_threads(a.threads)
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    points: list[Workload] = a.points
    models = tiny_models(max(w.context for w in points) + 64)
    if a.stub_device:
        from tokencache_models.testing.stubbed_device import stub_execute

        models = (stub_execute(models[0], a.stub_runner), stub_execute(models[1], a.stub_runner))
    jobs: list[tuple[Workload, int, float, str]] = []
    for w in points:
        for c in a.concurrency:
            bounds = [] if a.no_bounds else [(w, c, 0.0, s) for s in BOUNDS]
            routed = [(w, c, p, s) for p in a.rates for s in a.dispatches]
            # Long generations take minutes a row: the routed systems first (as given), so a
            # run cut short keeps the comparison. Rows are independent: order changes nothing.
            jobs += bounds + routed if w.name == "shared-prompt" else routed + bounds
    args = {k: v for k, v in vars(a).items() if k != "points"}
    args["workloads"] = [asdict(w) for w in points]
    bar = tqdm(jobs, desc="routing bench", file=sys.stderr) if tqdm else jobs
    rows: list[Row] = []
    for w, c, p, system in bar:
        at = argparse.Namespace(**{**vars(a), "max_running": c})
        n = a.requests_per_slot * c
        prompts = make_prompts(n, w.shared, w.unique, 512, a.seed, a.system_prompts)
        rows.append(run(system, p, prompts, w.shared, w.max_new, models, at, w.name))
        # A long run cut short keeps its rows (--from-json reports them).
        data = {"args": args, "partial": True, "rows": [asdict(r) for r in rows]}
        (out / "bench.json").write_text(json.dumps(data, indent=1))
    return rows, args


def tiny_models(positions: int) -> tuple[Any, Any]:
    from tokencache_models import ModelConfig, random_model

    def cfg(layers: int, hidden: int) -> Any:
        return ModelConfig(
            model_type="llama",
            vocab_size=512,
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden // 4,
            max_position_embeddings=positions,
        )

    small = random_model(cfg(1, 64), seed=1, std=0.1, attention_backend="torch").eval()
    large = random_model(cfg(2, 64), seed=2, std=0.1, attention_backend="torch").eval()
    return small, large


def percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def run(
    system: str,
    p: float,
    prompts: list[list[int]],
    shared: int,
    max_new: int,
    models: tuple[Any, Any],
    a: argparse.Namespace,
    workload: str = "shared-prompt",
) -> Row:
    """One system on one workload. a.clock "gpu" prices forwards with a GpuClock at
    a.small_shape / a.large_shape; "measured" uses their real (synchronised) times.
    The event loop is driven here one iteration at a time (RoutedEngine.iterate), so a
    StepTrace sees every small step: the per-step breakdown over the last
    a.breakdown_steps of them (one device only: with two the models overlap on the clock)."""
    from tokencache_routing import (
        BernoulliRouter,
        EngineConfig,
        GpuClock,
        RoutedEngine,
        SchedulerConfig,
        ScriptedRouter,
    )

    small, large = models
    names = (a.small_shape, a.large_shape)
    router: Any = BernoulliRouter(p, seed=a.seed)
    dispatch, mode = system, "events"
    if system in BOUNDS:
        one = small if system == "small alone" else large
        name = names[0] if system == "small alone" else names[1]
        small, large, names, router, dispatch = (
            one,
            one,
            (name, name),
            ScriptedRouter(),
            "tokencache",
        )
    elif system == "threaded":
        dispatch, mode = "tokencache", "threaded"
    clock: Any = "measured"
    shared_prefix = getattr(a, "shared_prefix", None)  # None: the profile's default
    if a.clock == "gpu" and a.profile.endswith(".json"):  # fresh GPU measurements, refitted
        clock = GpuClock.fit(a.profile, *names, shared_prefix=shared_prefix)
    elif a.clock == "gpu" and getattr(a, "large_tp", 1) > 1:  # the large model on TP GPUs
        from ..sim.tp_cost import tp_clock

        # The bounds run one model as both: "large alone" is the large model on its TP GPUs.
        large_tp = 1 if system == "small alone" else a.large_tp
        small_tp = a.large_tp if system == "large alone" else 1
        clock = tp_clock(*names, large_tp, shared_prefix, small_tp=small_tp)
    elif a.clock == "gpu":
        clock = GpuClock(*names, profile=a.profile, shared_prefix=shared_prefix)
    if mode == "threaded":
        clock = "measured"
    # Chunked prefill: --chunked-prefill / --large-chunked-prefill (None: SchedulerConfig's)
    chunking = {
        k: v
        for k, v in (
            ("chunked_prefill_size", getattr(a, "chunked_prefill", None)),
            ("large_chunked_prefill_size", getattr(a, "large_chunked_prefill", None)),
        )
        if v is not None
    }
    sched = SchedulerConfig(
        max_running=a.max_running,
        min_large_batch=a.min_large_batch,
        max_wait_steps=a.max_wait,
        max_wait_s=a.max_wait_ms / 1e3,
        min_occupancy=a.min_occupancy,
        max_parked=a.max_parked,
        launch=getattr(a, "launch", "threshold"),
        **chunking,
    )
    # Each system prompt once, each admitted request's own tokens, room for the cache to work.
    systems = system_prompts_of(prompts, shared)
    own = max(len(q) for q in prompts) - shared + max_new
    slots = len(systems) * shared + sched.max_admitted * own + 1024
    # What host time the clock charges (EngineConfig(host_charge=...)); not given:
    # the engine's default (an engine without the knob charges only the trees).
    charge: dict[str, Any] = {}
    if getattr(a, "host_charge", None) is not None:
        charge["host_charge"] = a.host_charge
    if dispatch == "tokencache" and getattr(a, "no_overlap", False):
        charge["overlap"] = False  # the serial host path (the engine's default overlaps)
    # A bound runs one model alone: its "large" side is never asked (the router never
    # escalates), so its pool holds one request's context, not a second copy of the whole
    # workload's (which ran a 32B model out of memory beside itself).
    large_slots = max(len(q) for q in prompts) + max_new + 64 if system in BOUNDS else None
    eng = RoutedEngine(
        small,
        large,
        router,
        config=EngineConfig(
            num_slots=slots,
            large_num_slots=large_slots,
            dispatch=cast("Dispatch", dispatch),  # a system's name; EngineConfig checks it
            scheduler=sched,
            clock=clock,
            mode=cast("Mode", mode),
            topology=a.topology,
            **charge,
        ),
    )
    warm = getattr(a, "warm_up", "pass")
    warmed: dict[str, Any] = {"warm_up": warm}
    if warm == "full":  # every graph the engine can replay, as a server before it listens
        made = eng.warm_up()
        warmed |= {"warm_up_keys": made.keys, "warm_up_memory_bytes": made.memory_bytes}
        warmed["warm_up_s"] = made.seconds
    # Prime both trees with every system prompt (a server's steady state), then measure.
    eng.router = ScriptedRouter(every=True)
    primes = [eng.submit(s, 1, route_key=-1 - k) for k, s in enumerate(systems)]
    for h in primes:
        h.wait()
    eng.router = router
    if warm == "pass":
        warmed["warm_up_s"] = warm_pass(eng, prompts, shared, max_new, mode)
    start, clock0 = eng.stats.copy(), eng.now()
    t0 = time.perf_counter()
    # --arrival-rate: a seeded Poisson schedule on the engine clock (0: all at once)
    rate = getattr(a, "arrival_rate", 0.0) or 0.0
    at: list[float | None] = [None] * len(prompts)
    if rate:
        at = [clock0 + t for t in arrival_times(len(prompts), rate, a.seed)]
    handles = [eng.submit(q, max_new, route_key=i, arrival_s=at[i]) for i, q in enumerate(prompts)]
    trace = None
    if mode == "events":
        trace = StepTrace(eng)
        trace.sample()
        bar = _progress(len(prompts) * max_new, f"{system} c={a.max_running} new={max_new}", a)
        done = 0
        while eng.iterate():
            trace.sample()
            if bar is not None:
                bar.update(eng.stats.tokens - start.tokens - done)
                done = eng.stats.tokens - start.tokens
        if bar is not None:
            bar.close()
    for h in handles:  # threaded: its workers run them; events: all done already
        h.wait()
    wall = time.perf_counter() - t0
    st = eng.stats.since(start)
    seconds = wall if mode == "threaded" else eng.now() - clock0
    ttft = [h.token_times[0] - h.submitted_at for h in handles if h.token_times]
    times = [h.token_times for h in handles]
    gaps = [b - a_ for ts in times for a_, b in itertools.pairwise(ts)]
    tpot = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times if len(ts) > 1]
    gpu = eng.gpu_clock
    # The catch-ups priced as the clock priced them (their groups' shared prefixes read once
    # when the clock's runner does that); and the least any schedule pays for the large model's
    # tokens: each escalation is one row of some forward over that request's whole context (the
    # next token is the small model's), so every schedule of this router's decisions reads at
    # least GpuClock.least_kv_read of these rows: with shared-prefix reads, each row's context
    # beyond the longest prefix two requests have in common (no two rows of a forward share
    # more slots than their tokens), and that prefix as few times as one forward of them all
    # would (a valid bound for any number of system prompts, looser with more).
    sizes, toks, kvs = st.catchup_batch_sizes, st.catchup_tokens, st.catchup_kv_tokens
    prefixes = st.catchup_shared_prefix
    extra: dict[str, Any] = {"topology": eng.topology, "system_prompts": len(systems)} | warmed
    extra["chunked_prefill"] = [sched.token_budget(0), sched.token_budget(1)]
    extra["arrival_rate"] = rate
    extra["launch"] = sched.launch
    extra["prefill_chunks"] = st.prefill_chunks
    extra["forward_paths"] = st.forward_paths
    # The gaps before the small model's tokens (their ITL): what other requests' prefills and
    # catch-ups cost a decoding request, without its own escalations' waits (the large
    # model's tokens).
    small_gaps = [
        b - a_
        for h in handles
        for (a_, b), m in zip(itertools.pairwise(h.token_times), h.models[1:], strict=True)
        if m == 0
    ]
    extra["itl_small_p50_ms"] = 1e3 * percentile(small_gaps, 0.5)
    extra["itl_small_p99_ms"] = 1e3 * percentile(small_gaps, 0.99)
    extra["itl_small_max_ms"] = 1e3 * max(small_gaps, default=float("nan"))
    extra["host_charge"] = getattr(eng, "host_charge", "trees")
    extra["overlap"] = bool(getattr(eng, "overlap", False))
    large_s, floor = st.large_forward_s, 0.0
    if gpu is not None:
        rows4 = list(zip(sizes, toks, kvs, prefixes, strict=True))
        large_s = sum(gpu.forward_s(1, b, t, kv, pre) for b, t, kv, pre in rows4)
        read = sum(gpu.kv_read(kv, pre) for kv, pre in zip(kvs, prefixes, strict=True))
        seqs = [[*q, *h.tokens] for q, h in zip(prompts, handles, strict=True)]
        shareable = longest_common_prefix(seqs)
        longest = max((pre.longest for pre in prefixes), default=0)
        assert longest <= shareable, "a forward shared more than its tokens"
        # One row per catch-up of a request, its whole context: a catch-up split in chunks
        # also read its earlier chunks' rows, which a schedule without chunks does not.
        rows_done = sum(sizes) - st.catchup_partial_rows
        least = gpu.least_kv_read(1, sum(kvs) - st.catchup_partial_kv_tokens, rows_done, shareable)
        floor = gpu.floor_s(1, sum(toks), least)
        # Catch-ups that read a prefix once, and how many groups they read at most.
        shared_catchups = sum(1 for pre in prefixes if pre.groups)
        most_groups = max((len(pre.groups) for pre in prefixes), default=0)
        extra |= {"shared_prefix": gpu.shared_prefix, "shareable_prefix": shareable,
                  "catchup_kv_context": sum(kvs), "catchup_kv_read": read,
                  "catchup_kv_floor": least, "catchups_sharing": shared_catchups,
                  "catchup_most_groups": most_groups}  # fmt: skip
    # A failed request first: its error says why (a device error ends requests and can leave
    # the engine not idle too, which would hide it).
    failed = [h for h in handles if h.finished_reason == "error"]
    assert not failed, f"{system}: {len(failed)} requests failed, first: {failed[0].error!r}"
    if not eng.idle_invariant():
        kv = {k: v for k, v in eng.metrics().items() if k.endswith(("_used", "_cached", "_pinned"))}
        raise AssertionError(f"{system}: engine not idle after the run: {kv}")
    # Tree-call timings the device refused to synchronise (ModelSide.timing_sync): 0 expected.
    extra["timing_sync_errors"] = sum(side.sync_errors for side in eng.sides)
    # EOS-free: every request wrote all its tokens, whatever system routed them.
    assert all(len(h.tokens) == max_new for h in handles), f"{system}: a request ended early"
    if trace is not None and eng.topology == "one-device":
        last = getattr(a, "breakdown_steps", 0) or 128  # kept in the JSON even when not printed
        extra["breakdown"] = trace.breakdown(last).as_dict()
        extra["per_step"] = trace.per_step()
    row = Row(
        context=len(prompts[0]) + max_new,
        p=p,
        system=system,
        clock=eng.gpu_clock.describe() if eng.gpu_clock is not None else "wall (this CPU)",
        requests=len(prompts),
        tokens=st.tokens,
        seconds=seconds,
        tokens_per_s=st.tokens / seconds if seconds else 0.0,
        ttft_p50_ms=1e3 * percentile(ttft, 0.5),
        itl_p50_ms=1e3 * percentile(gaps, 0.5),
        itl_p99_ms=1e3 * percentile(gaps, 0.99),
        tpot_p50_ms=1e3 * percentile(tpot, 0.5),
        tpot_p99_ms=1e3 * percentile(tpot, 0.99),
        occupancy=st.small_batch_occupancy,
        small_steps=st.steps,
        catchups=len(sizes),
        mean_catchup_batch=statistics.mean(sizes) if sizes else 0.0,
        bookkeeping_share=st.bookkeeping_s / seconds if seconds else 0.0,
        large_s=large_s,
        large_floor_s=floor,
        extra=extra,
        wall_s=wall,
        workload=workload,
        max_new=max_new,
        max_running=a.max_running,
        host_ms_per_small_step=1e3 * st.small_host_s / st.steps if st.steps else 0.0,
        gpu_idle_share=(
            st.device_idle_s / (st.device_idle_s + st.small_device_s) if st.device_idle_s else 0.0
        ),
        graph_share=st.graph_share() if st.forward_paths else math.nan,
    )
    eng.shutdown()  # its threads stopped; its pools and graphs go with the last reference
    return row


WARM_PASS_TOKENS = 64  # new tokens per request of the warm-up pass


def warm_pass(eng: Any, prompts: list[list[int]], shared: int, max_new: int, mode: str) -> float:
    """The workload once, untimed and shorter (min(max_new, WARM_PASS_TOKENS) new tokens), on
    prompts that share the system prompt but not their own tokens (so the timed run finds in
    the tree only what it would have found without the pass): the Triton compiles and the
    graph captures of the shapes the run uses happen here, not in its timed window. Returns
    its wall seconds."""
    t0 = time.perf_counter()
    vocab = eng.vocab_size
    others = [q[:shared] + [(t + 1 + vocab // 2) % vocab for t in q[shared:]] for q in prompts]
    n = min(max_new, WARM_PASS_TOKENS)
    handles = [eng.submit(q, n, route_key=len(prompts) + i) for i, q in enumerate(others)]
    if mode == "events":
        while eng.iterate():
            pass
    for h in handles:
        h.wait()
    return time.perf_counter() - t0


def _progress(total: int, desc: str, a: argparse.Namespace) -> Any:
    """A per-run progress bar over the tokens generated (long generations take minutes)."""
    if not getattr(a, "progress", False):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="tok", leave=False, file=sys.stderr)
