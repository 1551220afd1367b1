"""The GPU clock checked against what a GPU measured (the command:
`python -m tokencache_routing clock-check`, tools/clock_check.py).

RESULTS_DIR (default: benches/gpu/results/h200-2026-12-04) holds one GPU run's files:
decode_step.py's forward costs and routing_step.py's serving rows. The isolated forwards are
priced by the run's own decode_step.py file (GpuClock.fit), or by a shipped profile. Each
serving row says what its run computed: small steps, catch-ups and their mean batch, tokens,
prompt, occupancy. The clock prices that schedule (`price`): every small step a decode
forward at the row's mean batch and context, every catch-up a multi-token forward of the
row's mean catch-up batch, the prompts in chunked prefills, all on one device one after
another. The table gives the predicted tokens/s beside the measured one and the error, for
the clock of isolated forwards and for the clock with the engine's overhead
(`EngineOverhead`: what routing costs inside the engine beyond the isolated forwards, per
catch-up, fitted from the other warm routed rows of the same pair and workload).

--refit writes the overhead fitted from every warm routed row to RESULTS_DIR/engine.json and,
with --profile, to data/<profile>.engine.json, which GpuClock(profile) adds to its forwards.
--break-even prints, for each routed row, the escalation rate at which routing costs as
much as the large model alone (break_even).

A row is marked cold when it is the first of its run to use one of its forwards (a model's
decode or multi-token forward) at its context: runs before the benchmark's warm-up pass timed
that forward's Triton compiles and graph captures inside the row, which says nothing about
the clock. Cold rows are priced but not fitted.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tokencache_models import MIN_SHARED_PREFIX, PrefixGroup

from ..core.prefix import NO_PREFIX, PrefixRead
from .clock import (
    DATA,
    DEFAULT_PROFILE,
    EngineOverhead,
    GpuClock,
    Roofline,
    overhead_path,
)

SMALL, LARGE = 0, 1
ROUTED = "tokencache"
ALONE = ("small alone", "large alone")
FEW = 1e-9  # catch-ups: break_even's p -> 0


@dataclass(frozen=True)
class Schedule:
    """What one measured serving row computed, as its run recorded it."""

    source: str
    system: str
    workload: str
    p: float  # the escalation rate the row ran at
    small: str
    large: str
    context: int  # prompt + new tokens of a request
    requests: int
    tokens: int  # generated, in all
    unique_prompt: int  # each request's own prompt tokens (a shared system prompt is primed)
    max_running: int
    occupancy: float
    small_steps: int  # decode steps of the row's first model (the lone model of a bound)
    catchups: int
    mean_catchup_batch: float
    chunk: int
    seconds: float
    large_s: float  # measured time in the large model's forwards
    cold: bool

    @property
    def routed(self) -> bool:
        return self.system.startswith(ROUTED)

    @property
    def new_per_request(self) -> float:
        return self.tokens / self.requests

    @property
    def mean_context(self) -> float:
        """A decode step's mean context: the prompt plus half the new tokens."""
        return self.context - self.new_per_request / 2

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def schedules(results: Path) -> list[Schedule]:
    """Every priceable row of the routing_step.py files in `results`: the routed rows and the
    bounds (naive dispatch re-prefills, priced by its own model, not here); skipped and failed
    rows left out."""
    out: list[Schedule] = []
    for path in sorted(results.glob("routing_step*.json")):
        data = json.loads(path.read_text())
        args = data.get("args", {})
        seen: set[tuple[int, str]] = set()
        for row in data["rows"]:
            if "seconds" not in row:
                continue
            system = row["system"]
            uses = _forwards_used(system, data["small"], data["large"], row["context"])
            cold = not uses <= seen
            seen |= uses
            if not (system.startswith(ROUTED) or system in ALONE):
                continue
            extra = row.get("extra", {})
            out.append(
                Schedule(
                    source=path.name,
                    system=system,
                    workload=str(row.get("workload", args.get("workload", ""))),
                    p=float(row.get("p", 0.0)),
                    small=data["small"],
                    large=data["large"],
                    context=int(row["context"]),
                    requests=int(row["requests"]),
                    tokens=int(row["tokens"]),
                    unique_prompt=int(args.get("unique_prompt") or 0),
                    max_running=int(row.get("max_running") or args.get("max_running", 32)),
                    occupancy=float(row["occupancy"]),
                    small_steps=int(row["small_steps"]),
                    catchups=int(row["catchups"]),
                    mean_catchup_batch=float(row["mean_catchup_batch"]),
                    chunk=int((extra.get("chunked_prefill") or [2048])[0]),
                    seconds=float(row["seconds"]),
                    large_s=float(row["large_s"]),
                    cold=cold,
                )
            )
    return out


def _forwards_used(system: str, small: str, large: str, context: int) -> set[tuple[int, str]]:
    """The (context, model and forward kind) a row runs: its first run in a process compiles
    the kernels and captures the graphs (a row is cold unless each ran before it)."""
    if system == "small alone":
        kinds = {f"{small} decode", f"{small} multi"}
    elif system == "large alone":
        kinds = {f"{large} decode", f"{large} multi"}
    else:
        kinds = {f"{small} decode", f"{small} multi", f"{large} multi"}
    return {(context, k) for k in kinds}


@dataclass(frozen=True)
class Priced:
    """A schedule's modelled seconds, by part."""

    decode_s: float
    prefill_s: float
    catchup_s: float

    @property
    def seconds(self) -> float:  # one device: the parts run one after another
        return self.decode_s + self.prefill_s + self.catchup_s


def decode_kind(s: Schedule) -> int:
    return LARGE if s.system == "large alone" else SMALL


def price(clock: GpuClock, s: Schedule, catchups: float | None = None) -> Priced:
    """The clock's seconds for schedule `s` (catchups: that many catch-ups instead of the
    row's, carrying the same tokens; break_even's knob)."""
    kind = decode_kind(s)
    batch = max(1, round(s.occupancy * s.max_running))
    decode = s.small_steps * clock.forward_s(
        kind, batch, batch, round(batch * s.mean_context), _shared_read(clock, kind, s, batch)
    )
    prompt_tokens = s.requests * max(s.unique_prompt, 1)
    chunks = math.ceil(prompt_tokens / s.chunk)
    per_chunk = prompt_tokens / chunks
    rows = math.ceil(per_chunk / max(s.unique_prompt, 1))  # prompts a chunk holds
    prefill = chunks * clock.forward_s(kind, rows, per_chunk, per_chunk)
    n = s.catchups if catchups is None else catchups
    catchup = 0.0
    if s.routed and n > 0:
        # the large model reads each request's own prompt and every token before its last
        # escalation: about all of them, spread over the catch-ups
        m = s.mean_catchup_batch
        per_row = s.requests * (s.unique_prompt + s.new_per_request) / (n * m)
        catchup = n * clock.forward_s(LARGE, m, m * per_row, m * s.mean_context)
    return Priced(decode, prefill, catchup)


def _shared_read(clock: GpuClock, kind: int, s: Schedule, batch: int) -> PrefixRead:
    """How the clock's runner reads the prompt every row shares (a system prompt: the context
    less each request's own prompt and new tokens) in a decode step of `batch` rows."""
    shared = s.context - s.unique_prompt - round(s.new_per_request)
    if shared < MIN_SHARED_PREFIX or batch < 2:
        return NO_PREFIX
    group = PrefixGroup(tuple(range(batch)), shared)
    return clock.prefix_read(kind, [group], np.arange(batch + 1, dtype=np.int64))


def fit_overhead(clock: GpuClock, rows: Iterable[Schedule]) -> dict[str, EngineOverhead]:
    """The engine's overhead from warm routed rows, `clock` pricing isolated forwards: the
    measured time beyond the priced forwards, per catch-up, charged to the large model's
    multi-token forwards. What routing adds (parking, the catch-up's preparation and its
    synchronisation, the hand-back) comes with catch-ups; a lone model's steps pay none of
    it. Never negative."""
    catchups = 0
    extra = 0.0
    large = ""
    for s in rows:
        if not s.routed or s.cold or not s.catchups:
            continue
        extra += s.seconds - price(clock, s).seconds
        catchups += s.catchups
        large = s.large
    if not catchups:
        return {}
    return {large: EngineOverhead(multi_s=max(0.0, extra / catchups))}


@dataclass(frozen=True)
class ClockSource:
    """Where the isolated forwards' costs come from: a shipped profile (GpuClock(profile)) or
    a GPU run's own decode_step.py file (GpuClock.fit)."""

    profile: str | None = None
    forwards: Path | None = None

    def name(self) -> str:
        return f"forwards of {self.forwards}" if self.forwards else f"profile {self.profile}"

    def clock(self, small: str, large: str) -> GpuClock:
        """The clock of isolated forwards for the pair, fitted once (ValueError: it has no
        fit). Shared: derive others from it with with_overhead / graph_speed (copies)."""
        return _isolated_clock(self, small, large)


@functools.cache
def _isolated_clock(source: ClockSource, small: str, large: str) -> GpuClock:
    if source.forwards is not None:
        return GpuClock.fit(source.forwards, small, large)
    return GpuClock(small, large, source.profile or DEFAULT_PROFILE, engine_overhead=False)


def forwards_file(results: Path) -> Path | None:
    """decode_step.py's file among a run's results (its rows and its "checks"), if any."""
    for path in sorted(results.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "checks" in data and "rows" in data:
            return path
    return None


@dataclass(frozen=True)
class Check:
    schedule: Schedule
    isolated: Priced
    in_engine: Priced | None  # None: no warm routed row to fit the overhead from
    in_sample: bool = False  # the overhead was fitted on this row itself

    @staticmethod
    def error(priced: Priced | None, s: Schedule) -> float | None:
        """Predicted tokens/s over measured, minus one (+: the clock is optimistic)."""
        if priced is None:
            return None
        return s.seconds / priced.seconds - 1.0


def overhead_for(
    iso: GpuClock, s: Schedule, rows: Sequence[Schedule]
) -> tuple[dict[str, EngineOverhead], bool]:
    """The overhead to price row `s` with: fitted from the other warm routed rows of its pair
    and workload; from `s` itself (in sample: True) when it is the only one."""
    same = [r for r in rows if (r.small, r.large, r.workload) == (s.small, s.large, s.workload)]
    others = fit_overhead(iso, [r for r in same if r is not s])
    if others:
        return others, False
    return fit_overhead(iso, same), True


def check(source: ClockSource, rows: Sequence[Schedule]) -> list[Check | str]:
    """Each row priced by the source's clock, alone and with the overhead fitted from the
    other warm routed rows of the same pair and workload; a row whose pair the source cannot
    price is returned as the reason."""
    out: list[Check | str] = []
    for s in rows:
        try:
            iso = source.clock(s.small, s.large)
        except ValueError as e:
            out.append(f"{s.source} {s.system} @ {s.context}: not priced: {e}")
            continue
        overhead, in_sample = overhead_for(iso, s, rows)
        in_engine = price(iso.with_overhead(overhead), s) if overhead else None
        out.append(Check(s, price(iso, s), in_engine, in_sample))
    return out


def break_even(clock: GpuClock, s: Schedule, large_alone_s: float, p: float) -> float | None:
    """The escalation rate at which the routed row's schedule costs what the large model alone
    does (large_alone_s), the row's mean catch-up batch and its small steps held, the number of
    catch-ups in proportion to the rate (the row ran at p). None: routing costs more even
    without a catch-up."""
    # the limit p -> 0: almost no catch-up, but the large model still reads every token
    fixed = price(clock, s, catchups=FEW).seconds
    if fixed >= large_alone_s:
        return None
    lo, hi = 0.0, 1.0
    if price(clock, s, catchups=s.catchups * hi / p).seconds <= large_alone_s:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if price(clock, s, catchups=max(s.catchups * mid / p, FEW)).seconds <= large_alone_s:
            lo = mid
        else:
            hi = mid
    return lo


def graph_speed(clock: GpuClock, large: str) -> GpuClock:
    """The clock with the large model's multi-token forwards at its roofline (weights and KV
    read once at the bandwidth, or the FLOPs at peak, times 1.5): a catch-up at CUDA-graph
    speed, in a copy. A PROJECTION: no such catch-up has been measured."""
    fast = copy.copy(clock)
    small_cost, large_cost = clock.costs
    fast.costs = (small_cost, replace(large_cost, multi=Roofline.of(large), multi_overhead=0.0))
    return fast


def _fmt(v: float | None, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v * 100:+.0f}%" if pct else f"{v:.0f}"


def report(source: ClockSource, results: Path, with_break_even: bool) -> str:
    rows = schedules(results)
    lines = [
        f"clock: {source.name()}; measured rows: {results}",
        "",
        "| run | workload | row | context | measured tok/s | isolated forwards tok/s | error"
        " | in-engine tok/s | error |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    notes: list[str] = []
    for c in check(source, rows):
        if isinstance(c, str):
            notes.append(c)
            continue
        s = c.schedule
        name = s.system + (" (cold)" if s.cold else "") + (" (in sample)" if c.in_sample else "")
        eng = None if c.in_engine is None else s.tokens / c.in_engine.seconds
        lines.append(
            f"| {s.source} | {s.workload} | {name} | {s.context} | {s.tokens_per_s:.0f}"
            f" | {s.tokens / c.isolated.seconds:.0f} | {_fmt(Check.error(c.isolated, s), True)}"
            f" | {_fmt(eng)} | {_fmt(Check.error(c.in_engine, s), True)} |"
        )
    lines += ["", *notes]
    if with_break_even:
        lines += ["", *break_even_lines(source, rows)]
    return "\n".join(lines)


def break_even_lines(source: ClockSource, rows: Sequence[Schedule]) -> list[str]:
    out = [
        "| run | row | context | p | large alone s | p* (in-engine) | p* (isolated) "
        "| p* (catch-ups at roofline x1.5, projection) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in rows:
        if not s.routed or s.cold or not s.p:
            continue
        alone = [
            r
            for r in rows
            if r.system == "large alone"
            and (r.large, r.context, r.tokens) == (s.large, s.context, s.tokens)
        ]  # fmt: skip
        if not alone:
            continue
        # a warm one where the run has it (a long row's compiles are a small share of it)
        bound = ([r for r in alone if not r.cold] or alone)[-1]
        try:
            iso = source.clock(s.small, s.large)
        except ValueError:
            continue
        eng = iso.with_overhead(overhead_for(iso, s, rows)[0])
        t = bound.seconds
        name = s.system + (" (large alone cold)" if bound.cold else "")
        fast = graph_speed(iso, s.large)
        vals = [break_even(c, s, t, s.p) for c in (eng, iso, fast)]
        out.append(
            f"| {s.source} | {name} | {s.context} | {s.p} | {t:.1f} | "
            + " | ".join("routing never pays" if v is None else f"{v:.3f}" for v in vals)
            + " |"
        )
    return out


def refit(source: ClockSource, results: Path, data: Path | None = DATA) -> dict[str, Any]:
    """Fits the engine overhead from every warm routed row in `results` and writes it beside
    them (engine.json) and, for a shipped profile, as the profile's own
    (data/<profile>.engine.json, which GpuClock(profile) adds to its forwards)."""
    rows = [r for r in schedules(results) if r.routed and not r.cold]
    if not rows:
        raise SystemExit(f"{results}: no warm routed row to fit the engine overhead from")
    iso = source.clock(rows[0].small, rows[0].large)
    overhead = fit_overhead(iso, rows)
    body = {
        "clock": source.name(),
        "fitted_from": sorted({r.source for r in rows}),
        "method": "tools/clock_check.py --refit: warm routed rows, measured minus priced",
        "overhead": {
            m: {"decode_ms": o.decode_s * 1e3, "multi_ms": o.multi_s * 1e3}
            for m, o in overhead.items()
        },
    }
    text = json.dumps(body, indent=1) + "\n"
    (results / "engine.json").write_text(text)
    if source.profile is not None and data is not None:
        (data / overhead_path(source.profile).name).write_text(text)
    return body
