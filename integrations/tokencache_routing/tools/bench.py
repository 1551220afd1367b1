"""Serving benchmark of routed decode: naive dispatchers vs tokencache cursors, one harness.

    python -m tokencache_routing.bench [--quick] [--clock gpu|measured]
        [--profile h200-2026-11-30|h200-roofline] [--[no-]shared-prefix] [--large-tp N]
        [--workload shared-prompt|reasoning|long-input] [--max-new 512 2048 8192]
        [--concurrency 1 4 8 16 32 64 128] [--breakdown-steps 128]
        [--contexts 2048 8192] [--rates 0.05 0.1 0.2] [--max-running 32]
        [--system-prompts K] [--dispatches naive naive-sglang tokencache threaded] [--out DIR]

Workloads (bench_workloads.py; every request EOS-free, so every system writes the same
tokens): shared-prompt (the default, described next), reasoning (a 128-token shared system
prompt + 128 own tokens, 2048 new: long generations, where the naive trees get deep) and
long-input (2048 shared + 6144 own, 1024 new). --concurrency sweeps max_running (N =
--requests-per-slot x C); several --max-new values sweep the output length; both print a
summary table and a plot (bench_concurrency.png, bench_length.png). For reasoning and
long-input the report adds the per-step breakdown over the last 128 small steps (small and
large forward, tree insert/update, prefix match, lock, unlock, the rest) beside the published
one (TokenRouter, arXiv 2610.12242).

A serving workload: N = --requests-per-slot x max_running requests (a system prompt plus each
request's own text, --context tokens in all once generated) submitted at once and admitted
continuously as places free up. Request i starts with system prompt i mod K of K distinct ones
(--system-prompts, default 1: one prompt shared by all), each of the same length, all primed
in both trees. Tiny random models compute the tokens on this CPU; the engine clock prices every
forward (default --clock gpu: a GpuClock at Qwen3-0.6B / Qwen3-8B shapes on a GPU cost profile
fitted to H200 measurements, plus the tree bookkeeping measured here), so a schedule is judged
by GPU-shaped costs. Every system runs on the same modelled runner: with --shared-prefix (the
roofline profile's default) it reads the slot-list prefix each group of a forward's rows
shares (their system prompt) once per block of the group's query rows, not once per row; the
report's clock line says which, and how many system prompts. "threaded" runs on wall time (its
two workers really overlap), so its rows are CPU measurements whatever the clock.

Per (context, p, system): decode tokens/s, time to first token, TPOT (per request, as the
serving benchmarks define it) and ITL (every inter-token gap) p50/p99 (engine clock),
small-model batch occupancy (batch / min(max_running, admitted requests)), small steps,
catch-up batches, bookkeeping share (tree and cursor time measured here, over the
engine clock's time); bounds: the small model alone, the large model alone, the ideal
(small-alone time plus the tokencache run's large catch-up time) and the ceiling (small-alone
time plus the least the large model's tokens and KV reads can cost: each escalation's context,
less, with shared-prefix reads, the longest prefix two requests share, which is read only as
often as one forward of all of them would, whatever K: no one-device schedule beats it on the
GPU clock).
Markdown table on stdout, bench.json and bench.png (when matplotlib is installed) in --out.
The engine clock charges forwards and the engine's measured host time (RoutedEngine's
host_charge, default serial: with overlap the GPU waits only for what the pipeline cannot
hide; --host-charge trees charges the tree calls only); the report's
clock line says which. --stub-device times that host path without the CPU models' forwards
(zero logits, the same schedule): on this CPU each forward also evicts the host's caches. Its
host preparation is the GPU runner's (--stub-runner gpu, the default: what the engine does on
the GPU the clock prices) or this CPU's eager path (--stub-runner eager).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .bench_workloads import (
    WORKLOADS,
    StepTrace,
    Workload,
    arrival_times,
    breakdown_table,
    length_table,
    resolve,
    sweep_table,
)

SYSTEMS = ("naive", "naive-sglang", "tokencache", "threaded")
BOUNDS = ("small alone", "large alone")
LIMITS = ("ceiling", "ideal")  # computed from the rows, not run


@dataclass
class Row:
    context: int
    p: float
    system: str
    clock: str
    requests: int
    tokens: int
    seconds: float  # engine clock
    tokens_per_s: float
    ttft_p50_ms: float
    # Inter-token latency: the gaps between consecutive tokens of a request, over all tokens
    # (what this table called "TPOT" before 2026-12-02).
    itl_p50_ms: float
    itl_p99_ms: float
    occupancy: float
    small_steps: int
    catchups: int
    mean_catchup_batch: float
    bookkeeping_share: float  # tree and cursor time over the engine clock's time
    large_s: float = 0.0  # the large model's share of the clock (for the ideal)
    large_floor_s: float = 0.0  # the least the large model's work costs (for the ceiling)
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    workload: str = "shared-prompt"
    max_new: int = 0  # new tokens per request (EOS-free: every request writes them all)
    max_running: int = 0  # the small batch cap: the concurrency of a --concurrency sweep
    # The engine's host time per small step (everything but the forward's device work,
    # Stats.small_host_s) and the share of the small model's device time spent waiting for
    # the host (Stats.device_idle_s: all the host time without overlap, the late launches
    # with it) over idle + busy. Event-loop rows only (0 for threaded ones).
    host_ms_per_small_step: float = 0.0
    gpu_idle_share: float = 0.0
    # Time per output token as vLLM's and SGLang's serving benchmarks define it: per request,
    # (last token's time - first token's) / (tokens - 1), its percentiles over requests
    # (NaN in rows of older runs, which kept only the gaps).
    tpot_p50_ms: float = math.nan
    tpot_p99_ms: float = math.nan
    # Graph coverage: the share of both models' forwards that did not run eagerly (CUDA-graph
    # replays; off CUDA, a graph runner's static path), Stats.graph_share; the counts by path
    # are in extra["forward_paths"]. NaN in rows of older runs.
    graph_share: float = math.nan


def point(r: Row) -> tuple[str, int, int, int]:
    """Rows at one point of the workload (compared with each other: x naive, the limits)."""
    return r.workload, r.context, r.max_new, r.max_running


def percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def make_prompts(
    n: int, shared: int, unique: int, vocab: int, seed: int, system_prompts: int = 1
) -> list[list[int]]:
    """n prompts: prompt i is system prompt i mod system_prompts (each `shared` random tokens)
    plus `unique` of its own. The system prompts are drawn first, so one prompt gives the
    same prompts whatever the count (K=1 is the historical workload, bit for bit)."""
    if system_prompts < 1:
        raise ValueError(f"system_prompts must be >= 1, got {system_prompts}")
    rng = __import__("numpy").random.default_rng(seed)
    bases = [rng.integers(0, vocab, shared).tolist() for _ in range(system_prompts)]
    return [bases[i % system_prompts] + rng.integers(0, vocab, unique).tolist() for i in range(n)]


def system_prompts_of(prompts: Sequence[Sequence[int]], shared: int) -> list[list[int]]:
    """The distinct `shared`-token system prompts of prompts, in order of first use."""
    return [list(s) for s in dict.fromkeys(tuple(q[:shared]) for q in prompts)]


def longest_common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    """The longest prefix two of seqs (different entries) have in common: the most KV slots two
    requests' rows can share (equal slots hold equal tokens). The adjacent pairs in sorted
    order include the best pair."""
    import numpy as np

    best = 0
    for x, y in itertools.pairwise(sorted(tuple(q) for q in seqs)):
        m = min(len(x), len(y))
        diff = np.flatnonzero(np.asarray(x[:m]) != np.asarray(y[:m]))
        best = max(best, int(diff[0]) if len(diff) else m)
    return best


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
    # What host time the clock charges (RoutedEngine(host_charge=...)); not given:
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
        slots,
        large_num_slots=large_slots,
        dispatch=dispatch,
        scheduler=sched,
        clock=clock,
        mode=mode,
        topology=a.topology,
        **charge,
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


HEADER = (
    "| L | p | system | tok/s | x naive | x naive-sglang | x large alone | TTFT p50 ms | "
    "TPOT p50 / p99 ms | ITL p50 / p99 ms | occupancy | small steps | catch-ups | "
    "mean catch-up | bookkeeping | host ms / small step | GPU idle | graphs |\n"
    "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def ratio(r: Row, rows: list[Row], system: str) -> str:
    """r's tokens/s over the `system` row's at r's workload point (its rate too, unless a
    bound's), on the same clock; "-" without one."""
    base = next(
        (
            q
            for q in rows
            if q.system == system
            and point(q) == point(r)
            and (system in BOUNDS or q.p == r.p)
            and q.clock == r.clock
            and q.tokens_per_s
        ),
        None,
    )
    return f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base is not None else "-"


def table(rows: list[Row]) -> str:
    out = [HEADER]
    for r in rows:
        x = " | ".join(ratio(r, rows, s) for s in ("naive", "naive-sglang", "large alone"))
        p = "-" if r.system in BOUNDS else f"{r.p:.2f}"
        out.append(
            f"| {r.context} | {p} | {r.system} | {r.tokens_per_s:.0f} | {x} | "
            f"{r.ttft_p50_ms:.1f} | {r.tpot_p50_ms:.1f} / {r.tpot_p99_ms:.1f} | "
            f"{r.itl_p50_ms:.1f} / {r.itl_p99_ms:.1f} | "
            f"{100 * r.occupancy:.0f}% | {r.small_steps} | {r.catchups} | "
            f"{r.mean_catchup_batch:.1f} | {100 * r.bookkeeping_share:.2f}% | "
            f"{r.host_ms_per_small_step:.3f} | {100 * r.gpu_idle_share:.0f}% | "
            f"{100 * r.graph_share:.0f}% |"
        )
    return "\n".join(out)


def limit_row(rows: list[Row], at: tuple[str, int, int, int], p: float, kind: str) -> Row | None:
    """ideal: small-alone time plus the tokencache run's large catch-up time (this schedule's
    catch-ups, nothing waiting). ceiling: small-alone time (full batches of max_running) plus
    the least the large model's tokens and KV reads in this run can cost on the clock
    (GpuClock.floor_s of GpuClock.least_kv_read: with shared-prefix reads, each escalation's
    context beyond the shareable prefix, and that prefix read as few times as possible): no
    one-device schedule computing those tokens beats it, but for the bookkeeping measured on
    this CPU (GPU clock only). `at`: the workload point (point(row))."""
    alone = next((r for r in rows if r.system == "small alone" and point(r) == at), None)
    tc = next((r for r in rows if r.system == "tokencache" and (point(r), r.p) == (at, p)), None)
    if alone is None or tc is None or (kind == "ceiling" and not tc.large_floor_s):
        return None
    large = tc.large_s if kind == "ideal" else tc.large_floor_s
    # Two devices: the models run side by side, so the slower of the two bounds the run.
    two = tc.extra.get("topology") == "two-devices"
    seconds = max(alone.seconds, large) if two else alone.seconds + large
    nan = float("nan")
    return Row(tc.context, p, kind, tc.clock, tc.requests, tc.tokens, seconds,
               tc.tokens / seconds, nan, nan, nan, 1.0, alone.small_steps, tc.catchups,
               tc.mean_catchup_batch, 0.0, workload=tc.workload, max_new=tc.max_new,
               max_running=tc.max_running)  # fmt: skip


def plot(rows: list[Row], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('plot skipped: matplotlib is not installed (pip install "./integrations[bench]")')
        return False
    contexts = sorted({r.context for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4), squeeze=False)
    for ax, ctx in zip(axes[0], contexts, strict=True):
        for system in [*SYSTEMS, *LIMITS]:
            pts = sorted(
                (r.p, r.tokens_per_s) for r in rows if r.context == ctx and r.system == system
            )
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=system)
        for r in rows:
            if r.context == ctx and r.system in BOUNDS:
                ax.axhline(r.tokens_per_s, ls="--", lw=1, label=r.system,
                           color="green" if r.system.startswith("small") else "gray")  # fmt: skip
        ax.set_title(f"context {ctx}")
        ax.set_xlabel("routing rate p")
        ax.set_ylabel("decode tokens/s (engine clock)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run (seconds)")
    ap.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="shared-prompt",
        help="shared-prompt: a long primed system prompt (--contexts) + 32 own, 32 new; "
        "reasoning: 128 shared + 128 own, 2048 new; long-input: 2048 shared + 6144 own, 1024 "
        "new (bench_workloads.py); every request EOS-free",
    )
    ap.add_argument("--clock", choices=["gpu", "measured"], default="gpu")
    ap.add_argument(
        "--profile",
        default="h200-2026-11-30",
        help="GpuClock profile, or a JSON of GPU measurements to fit (data/*.json's rows, or a "
        "benches/gpu/results/ file that decode_step.py wrote)",
    )
    ap.add_argument(
        "--shared-prefix",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether the clock's runner reads a forward's shared slot-list prefix once "
        "(default: the profile's: on for h200-roofline, off for measured fits)",
    )
    ap.add_argument("--small-shape", default="qwen3-0.6b", help="model shape the clock prices")
    ap.add_argument("--large-shape", default="qwen3-8b")
    ap.add_argument(
        "--large-tp",
        type=int,
        default=1,
        metavar="N",
        help="price the large model tensor-parallel over N GPUs (tp_cost.py: each rank's "
        "roofline share plus the all-reduces at published NVLink figures; h200-roofline only); "
        "'large alone' is then the large model alone on its N GPUs",
    )
    ap.add_argument(
        "--contexts", type=int, nargs="+", default=[2048, 8192], help="shared-prompt only"
    )
    ap.add_argument("--rates", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        metavar="C",
        help="a sweep: each C as max_running, N = requests-per-slot x C (default: --max-running)",
    )
    ap.add_argument(
        "--requests-per-slot",
        type=int,
        default=None,
        help="N = this x max_running (default: 4 for shared-prompt, 1 otherwise)",
    )
    ap.add_argument(
        "--max-new", type=int, nargs="+", default=None, help="new tokens (default: the workload's)"
    )
    ap.add_argument(
        "--unique-prompt", type=int, default=None, help="each request's own tokens (workload's)"
    )
    ap.add_argument(
        "--system-tokens",
        type=int,
        default=None,
        help="system prompt length (reasoning, long-input: the workload's; shared-prompt: "
        "what --contexts leaves)",
    )
    ap.add_argument(
        "--system-prompts",
        type=int,
        default=1,
        metavar="K",
        help="distinct system prompts (each of the same length; request i gets prompt i mod K)",
    )
    ap.add_argument(
        "--warm-up",
        choices=["pass", "full", "none"],
        default="pass",
        help="before each row's timed window: pass (the workload once, shorter and on other "
        "prompts: its compiles and graph captures), full (RoutedEngine.warm_up: every graph "
        "the engine can replay, as a server) or none (a cold row)",
    )
    ap.add_argument(
        "--breakdown-steps",
        type=int,
        default=None,
        help="print the per-step breakdown over the last this many small steps (default: 128 "
        "for reasoning and long-input, off for shared-prompt)",
    )
    ap.add_argument(
        "--launch",
        choices=["threshold", "cost"],
        default="threshold",
        help="SchedulerConfig.launch: when a catch-up launches on one device: threshold "
        "(--min-large-batch, --max-wait, --min-occupancy) or cost (when the holes' accumulated "
        "cost on the clock reaches a catch-up's fixed cost; --max-wait then caps the wait, "
        "default no cap)",
    )
    ap.add_argument("--min-large-batch", type=int, default=32)
    ap.add_argument(
        "--max-wait",
        type=int,
        default=None,
        help="max wait in small steps (default 8; with --launch cost 0: no cap)",
    )
    ap.add_argument("--min-occupancy", type=float, default=0.8, help="SchedulerConfig's")
    ap.add_argument(
        "--max-parked", type=int, default=None, help="SchedulerConfig's (default: max-running)"
    )
    ap.add_argument(
        "--max-wait-ms",
        type=float,
        default=None,
        help="threaded: max wait (ms; default 5; with --launch cost 0: no cap)",
    )
    ap.add_argument(
        "--chunked-prefill",
        type=int,
        default=None,
        metavar="N",
        help="SchedulerConfig.chunked_prefill_size: the most tokens a step computes, a long "
        "prefill or catch-up split across steps (0: off; default: SchedulerConfig's, 2048)",
    )
    ap.add_argument(
        "--large-chunked-prefill",
        type=int,
        default=None,
        metavar="N",
        help="SchedulerConfig.large_chunked_prefill_size: the catch-ups' budget (0: off; "
        "default: --chunked-prefill's)",
    )
    ap.add_argument(
        "--arrival-rate",
        type=float,
        default=0.0,
        metavar="R",
        help="requests arrive as a Poisson process of R a second on the engine clock, seeded "
        "by --seed (bench_workloads.arrival_times; TTFT counts from each arrival; event-loop "
        "rows only); 0 (default): all at once",
    )
    ap.add_argument("--dispatches", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument(
        "--topology",
        choices=["one-device", "two-devices"],
        default="one-device",
        help="event loop clock: catch-ups between small steps, or beside them on a second GPU",
    )
    ap.add_argument(
        "--no-bounds", action="store_true", help="skip small/large alone, ideal and ceiling"
    )
    ap.add_argument(
        "--host-charge",
        default=None,
        help="RoutedEngine's host_charge, where the engine has it (serial, overlap or trees); "
        "default: the engine's",
    )
    ap.add_argument(
        "--no-overlap",
        action="store_true",
        help="tokencache without overlapped scheduling (RoutedEngine(overlap=False)): the "
        "serial host path, every host microsecond on the GPU's clock",
    )
    ap.add_argument(
        "--stub-device",
        action="store_true",
        help="the CPU models' forwards return zero logits at once (tokencache_models.stub): the "
        "host path timed without them (on this CPU each also evicts the host's caches between "
        "steps, which a GPU's forward does not); the schedule is the same (the Bernoulli router "
        "and EOS-free lengths ignore the logits), the tokens are 0. GPU clock only",
    )
    ap.add_argument(
        "--stub-runner",
        choices=("gpu", "eager"),
        default=None,
        help="with --stub-device, whose host preparation the forwards get: gpu (default), what "
        "the engine prepares on the GPU the clock prices (Triton's plan and shared-prefix "
        "tables, decode steps padded into a graph runner's buffers); eager, this CPU's torch "
        "path (ForwardContext.build each step)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-out/routing", help="folder for bench.json, bench.png")
    ap.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        metavar="JSON",
        help="run nothing: report (tables, plots) the rows of earlier runs' bench.json, merged",
    )
    a = ap.parse_args(argv)
    if a.system_prompts < 1:
        ap.error(f"--system-prompts must be >= 1, got {a.system_prompts}")
    for name in ("chunked_prefill", "large_chunked_prefill"):
        if (getattr(a, name) or 0) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0 (0: off)")
    for name in ("concurrency", "max_new"):
        if any(v < 1 for v in getattr(a, name) or ()):
            ap.error(f"--{name.replace('_', '-')} values must be >= 1")
    if a.large_tp < 1:
        ap.error(f"--large-tp must be >= 1, got {a.large_tp}")
    if a.large_tp > 1 and (a.clock != "gpu" or a.profile != "h200-roofline"):
        ap.error("--large-tp prices the h200-roofline profile only (a measured fit is one GPU's)")
    if not math.isfinite(a.arrival_rate) or a.arrival_rate < 0:
        ap.error(f"--arrival-rate must be a finite number >= 0, got {a.arrival_rate}")
    if a.arrival_rate and "threaded" in a.dispatches:
        ap.error("--arrival-rate schedules arrivals on the event loop's clock: no threaded rows")
    if a.stub_device and (a.clock != "gpu" or "threaded" in a.dispatches):
        ap.error("--stub-device needs --clock gpu and no threaded rows (their time is wall time)")
    if a.stub_runner is not None and not a.stub_device:
        ap.error("--stub-runner chooses the stubbed models' host path: it needs --stub-device")
    if a.stub_device and a.stub_runner is None:
        a.stub_runner = "gpu"
    cost = a.launch == "cost"
    if a.max_wait is None:
        a.max_wait = 0 if cost else 8
    if a.max_wait_ms is None:
        a.max_wait_ms = 0.0 if cost else 5.0
    if a.quick:
        a.contexts, a.rates, a.max_running, a.min_large_batch = [96], [0.1], 4, 2
    a.points = resolve(a)  # fills the workload's defaults in
    if a.breakdown_steps is None:
        a.breakdown_steps = 0 if a.workload == "shared-prompt" else 128
    a.concurrency = a.concurrency or [a.max_running]
    a.progress = True
    return a


def arrival_note(args: dict[str, Any]) -> str:
    rate = args.get("arrival_rate") or 0.0
    if not rate:
        return "all submitted at once, "
    return f"Poisson arrivals at {rate:g} requests/s (seed {args['seed']}), "


def launch_note(args: dict[str, Any]) -> str:
    """The launch policy the runs used (SchedulerConfig.launch and its knobs)."""
    if args.get("launch", "threshold") == "cost":
        cap = args["max_wait"]
        return f"launch cost (ski rental on the clock's prices), max_wait {cap or 'none'}"
    return (
        f"min_large_batch {args['min_large_batch']}, max_wait {args['max_wait']} steps, "
        f"min_occupancy {args['min_occupancy']}"
    )


def chunk_note(rows: Sequence[Row]) -> str:
    """The token budgets the rows ran with (SchedulerConfig.token_budget, small / large)."""
    seen = sorted({tuple(r.extra["chunked_prefill"]) for r in rows if "chunked_prefill" in r.extra})
    if not seen:
        return "chunked prefill not recorded"
    parts = [f"{s} / {g}" if s != g else f"{s}" for s, g in seen]
    return f"chunked prefill {' | '.join(parts)} tokens a step (small / large; 0: off)"


def host_note(rows: Sequence[Row]) -> str:
    """What host time the clock line's clock charges: an engine without host_charge (an older
    one, whose rows a report may reload) charges the trees only, and the report says so."""
    charges = sorted({r.extra.get("host_charge", "trees") for r in rows if r.system in SYSTEMS})
    if charges in ([], ["trees"]):
        return "host time outside the trees not charged"
    overlap = {r.extra.get("overlap", False) for r in rows if r.system == "tokencache"}
    how = {
        frozenset(): "",
        frozenset({True}): "; tokencache overlapped",
        frozenset({False}): "; tokencache serial",
    }
    return (
        f"host time charged: {'/'.join(charges)} (RoutedEngine host_charge)"
        f"{how.get(frozenset(overlap), '; tokencache overlapped and serial')}"
    )


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.from_json:
        rows, args = load_rows(a.from_json)
    else:
        rows, args = measure(a, out)
    if not args.get("no_bounds"):
        for at_point in dict.fromkeys(point(r) for r in rows if r.system not in LIMITS):
            for p in sorted({r.p for r in rows if r.system not in BOUNDS}):
                for kind in LIMITS:
                    known = any((point(r), r.p, r.system) == (at_point, p, kind) for r in rows)
                    r = None if known else limit_row(rows, at_point, p, kind)
                    if r is not None:
                        rows.append(r)
    order = {s: i for i, s in enumerate([*BOUNDS, *LIMITS, *SYSTEMS])}
    rows.sort(
        key=lambda r: (
            r.workload,
            r.max_running,
            r.context,
            r.p if r.system not in BOUNDS else -1,
            order[r.system],
        )
    )
    report(rows, args)
    (out / "bench.json").write_text(
        json.dumps({"args": args, "partial": False, "rows": [asdict(r) for r in rows]}, indent=1)
    )
    from .bench_plots import plot_concurrency, plot_length

    cs = sorted({r.max_running for r in rows})
    news = sorted({r.max_new for r in rows})
    plots = []
    if len(cs) > 1 and plot_concurrency(rows, out / "bench_concurrency.png"):
        plots.append(out / "bench_concurrency.png")
    if len(news) > 1 and plot_length(rows, out / "bench_length.png"):
        plots.append(out / "bench_length.png")
    if len(cs) == 1 and len(news) == 1 and plot(rows, out / "bench.png"):
        plots.append(out / "bench.png")
    for path in plots:
        print(f"\nplot: {path}")
    print(f"json: {out / 'bench.json'}")


def measure(a: argparse.Namespace, out: Path) -> tuple[list[Row], dict[str, Any]]:
    """Runs every job of the command line; bench.json is rewritten after every row."""
    from tokencache_extras import require_or_exit

    require_or_exit("torch", "tokencache_models", extra="routing", prog="tokencache_routing.bench")
    import torch

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
        from tokencache_models.stub import stub_execute

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


def _renamed(r: dict[str, Any]) -> dict[str, Any]:
    """A row of a run before 2026-12-02, whose "tpot" figures were the per-token gaps (ITL),
    in today's names (its per-request TPOT unknown: NaN)."""
    if "itl_p50_ms" in r:
        return r
    r = dict(r)
    r["itl_p50_ms"], r["itl_p99_ms"] = r.pop("tpot_p50_ms"), r.pop("tpot_p99_ms")
    extra = r["extra"] = dict(r.get("extra", {}))
    for q in ("p50", "p99", "max"):
        if f"tpot_small_{q}_ms" in extra:
            extra[f"itl_small_{q}_ms"] = extra.pop(f"tpot_small_{q}_ms")
    return r


def load_rows(paths: Sequence[str]) -> tuple[list[Row], dict[str, Any]]:
    """Rows of earlier runs' bench.json files (merged: say, one run per output length), and
    the first file's arguments with each workload and concurrency of them all."""
    rows: list[Row] = []
    args: dict[str, Any] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        rows += [Row(**_renamed(r)) for r in data["rows"] if r["system"] not in LIMITS]
        mine = data["args"]
        if not args:
            args = dict(mine)
            args["workloads"], args["concurrency"] = [], []
        args["workloads"] += [w for w in mine["workloads"] if w not in args["workloads"]]
        args["concurrency"] += [c for c in mine["concurrency"] if c not in args["concurrency"]]
        args["no_bounds"] = args["no_bounds"] and mine["no_bounds"]
    args["from_json"] = list(paths)
    return rows, args


def report(rows: list[Row], args: dict[str, Any]) -> None:
    """The clock line, each workload's shape, one table per (workload, concurrency), then the
    sweeps' summaries and the breakdown."""
    clock = next((r.clock for r in rows if r.system not in (*BOUNDS, "threaded")), "wall")
    cs = sorted({r.max_running for r in rows})
    news = sorted({r.max_new for r in rows})
    rps = args["requests_per_slot"]
    n_text = (
        f"{rps * cs[0]} requests, max_running {cs[0]}"
        if len(cs) == 1
        else f"{rps} x C requests, max_running C in {cs}"
    )
    k = args["system_prompts"]
    stub = ""
    if args.get("stub_device"):  # runs before --stub-runner had the eager path only
        stub = f"; device work stubbed (--stub-device, {args.get('stub_runner', 'eager')} runner)"
    print(
        f"clock: {clock} + bookkeeping measured here ({host_note(rows)}{stub}); threaded rows: "
        f"wall time on this CPU. {n_text}, {'/'.join(map(str, news))} new tokens each, "
        f"{launch_note(args)}, topology {args['topology']}, {arrival_note(args)}"
        f"{k} system prompt{'s' if k > 1 else ''}, {chunk_note(rows)}"
    )
    for w in args["workloads"]:
        print(Workload(**w).describe())
    groups = list(dict.fromkeys((r.workload, r.max_running) for r in rows))
    for wl, c in groups:
        if len(groups) > 1:
            print(f"\n{wl}, concurrency {c} ({rps * c} requests):")
        print()
        print(table([r for r in rows if (r.workload, r.max_running) == (wl, c)]))
        chunked = [r for r in rows if (r.workload, r.max_running) == (wl, c)]
        chunked = [r for r in chunked if "itl_small_p99_ms" in r.extra]
        if chunked:
            print("\nITL of the small model's tokens (the gaps escalations' own waits leave out):")
            for r in chunked:
                e = r.extra
                print(
                    f"  {r.system} p={r.p:.2f} (budget {e['chunked_prefill'][0]} / "
                    f"{e['chunked_prefill'][1]}, {e['prefill_chunks']} chunked rows): "
                    f"p50 {e['itl_small_p50_ms']:.2f} ms, p99 {e['itl_small_p99_ms']:.2f} ms, "
                    f"max {e.get('itl_small_max_ms', float('nan')):.1f} ms"
                )
    if len(cs) > 1:
        print(sweep_table(rows))
    if len(news) > 1:
        print(length_table(rows))
    if args["breakdown_steps"]:
        print(breakdown_table(rows))


if __name__ == "__main__":
    main()
