"""The serving benchmark's named workloads, its per-step trace and the summary tables.

Workloads (`bench --workload NAME`), each request EOS-free (no eos or stop token: every system
generates exactly max_new tokens per request, the same count whatever routes them):

- shared-prompt: today's default: a long system prompt shared by all (--contexts L: L - new -
  own tokens), each request's own 32 tokens, 32 new tokens, 4 requests per batch place.
- reasoning (AIME-style): a short shared system prompt (128 tokens) plus each request's own
  question (128), 2048 new tokens (--max-new 512 2048 8192), one request per batch place.
- long-input (SWE-bench-style): about 8k prompt tokens, 2048 shared (system prompt and tool
  descriptions) plus 6144 of the request's own (the issue and its files), 1024 new.

The trace (StepTrace) snapshots the engine's cumulative counters after every event-loop
iteration (one small step, and the catch-up run before it, if any): the engine clock, each
model's forwards priced on the clock, and the tree time by operation (ModelSide.bookkeeping_by_op,
both models' trees). The published breakdown (TokenRouter, arXiv 2610.12242) is per step over the
last 128 small-model steps of a generation; `StepTrace.breakdown` gives ours in the same terms.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

WORKLOADS = ("shared-prompt", "reasoning", "long-input")


@dataclass(frozen=True)
class Workload:
    """One benchmark shape: `shared` system-prompt tokens (one of --system-prompts, primed in
    both trees) plus `unique` tokens of each request's own, then `max_new` new tokens."""

    name: str
    shared: int
    unique: int
    max_new: int

    @property
    def prompt(self) -> int:
        return self.shared + self.unique

    @property
    def context(self) -> int:
        return self.prompt + self.max_new

    def describe(self) -> str:
        return (
            f"workload {self.name}: {self.shared}-token shared system prompt + {self.unique} "
            f"own tokens, {self.max_new} new tokens per request (EOS-free)"
        )


@dataclass(frozen=True)
class Defaults:
    shared: int | None  # None: from --contexts (shared-prompt)
    unique: int
    max_new: tuple[int, ...]
    requests_per_slot: int


DEFAULTS = {
    "shared-prompt": Defaults(None, 32, (32,), 4),
    "reasoning": Defaults(128, 128, (2048,), 1),
    "long-input": Defaults(2048, 6144, (1024,), 1),
}
# --quick: seconds on a CPU. A 64-token system prompt is the least a shared-prefix group reads
# once (tokencache_models.MIN_SHARED_PREFIX), so the reasoning smoke still exercises it.
QUICK = {
    "shared-prompt": Defaults(None, 8, (8,), 2),
    "reasoning": Defaults(64, 8, (48,), 1),
    "long-input": Defaults(64, 160, (12,), 1),
}


def resolve(a: argparse.Namespace) -> list[Workload]:
    """The workload points of a parsed command line (filling the workload's defaults into
    a.unique_prompt, a.max_new, a.requests_per_slot where they were not given)."""
    d = (QUICK if a.quick else DEFAULTS)[a.workload]
    if a.unique_prompt is None:
        a.unique_prompt = d.unique
    if a.max_new is None:
        a.max_new = list(d.max_new)
    if a.requests_per_slot is None:
        a.requests_per_slot = d.requests_per_slot
    shared = a.system_tokens if a.system_tokens is not None else d.shared
    if shared is None:  # shared-prompt: the system prompt fills each context
        return [
            Workload(a.workload, max(1, ctx - m - a.unique_prompt), a.unique_prompt, m)
            for ctx in a.contexts
            for m in a.max_new
        ]
    return [Workload(a.workload, shared, a.unique_prompt, m) for m in a.max_new]


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """When each of n requests arrives, in seconds after the first (which arrives at 0): a
    Poisson process of `rate` requests a second on the engine clock (exponential gaps drawn
    from numpy's default_rng(seed)), so one seed gives one schedule; rate 0: all at once
    (the benchmark's historical shape). With staggered arrivals a late request's prefill
    (and first catch-up) lands in the middle of the others' decoding, which is what chunked
    prefill is for (bench --arrival-rate)."""
    if not math.isfinite(rate) or rate < 0:
        raise ValueError(f"arrival rate must be a finite number >= 0, got {rate!r}")
    if rate == 0 or n <= 0:
        return [0.0] * max(n, 0)
    import numpy as np

    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


# ---------------------------------------------------------------- the per-step trace

# The breakdown's parts, in the published profile's terms; "rest" is the clock less the other
# parts: other tree work (eviction) and, once the engine charges it, the host path outside the
# trees. It dips below 0 by tree time the clock does not charge: the tokencache scheduler's
# admission hold-back check (a match at admission, outside any forward's host window).
PARTS = (
    "small forward",
    "large forward",
    "tree insert/update",
    "prefix match",
    "lock",
    "unlock",
    "rest",
)
# ModelSide.bookkeeping_by_op names per part: a tokencache cursor's batched append ("extend")
# is its insert/update; the naive dispatchers insert when a request leaves a model.
OPS = {
    "tree insert/update": ("insert", "extend"),
    "prefix match": ("match",),
    "lock": ("lock",),
    "unlock": ("unlock",),
}
# TokenRouter (arXiv 2610.12242), SGLang 0.5.1, Qwen3-0.6B + Qwen3-32B, last 128 steps of a
# 2048-token generation: ms per step and share. It lists no large-model term: "rest" is what
# its five shares leave (11.0% of a 37.2 ms step), derived here, not published.
PAPER_MS = {
    "small forward": 1.56,
    "tree insert/update": 12.12,
    "prefix match": 7.78,
    "lock": 6.49,
    "unlock": 5.13,
}
PAPER_SHARE = {
    "small forward": 0.042,
    "tree insert/update": 0.326,
    "prefix match": 0.209,
    "lock": 0.175,
    "unlock": 0.138,
}
PAPER_STEP_MS = sum(PAPER_MS.values()) / sum(PAPER_SHARE.values())


@dataclass(frozen=True)
class Sample:
    """Cumulative counters after one event-loop iteration."""

    steps: int  # small steps so far
    clock: float  # engine clock (s)
    small_s: float  # small forwards priced on the clock (s)
    large_s: float  # large forwards (catch-ups) priced on the clock
    ops: dict[str, float]  # tree time by operation, both models (s)


@dataclass(frozen=True)
class Breakdown:
    """Per small step over a window of `steps` small steps: each part in seconds, summing to
    `total` (the engine clock over the window)."""

    steps: int
    first_step: int  # the window's first small step (1-based)
    total: float
    parts: dict[str, float]

    def ms(self, part: str) -> float:
        return 1e3 * self.parts[part] / self.steps if self.steps else float("nan")

    def share(self, part: str) -> float:
        return self.parts[part] / self.total if self.total else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "first_step": self.first_step,
            "step_ms": 1e3 * self.total / self.steps if self.steps else float("nan"),
            "ms_per_step": {p: self.ms(p) for p in PARTS},
            "share": {p: self.share(p) for p in PARTS},
        }


class StepTrace:
    """Records a RoutedEngine's counters after each iteration of its event loop.

    Forwards are priced by the engine's own `forward_cost` (the engine keeps no per-forward
    clock cost), wrapped on this instance only: the trace sums what it returns per model."""

    def __init__(self, eng: Any) -> None:
        self.eng = eng
        self.forward = [0.0, 0.0]  # clock seconds of small / large forwards so far
        inner: Callable[..., float] = eng.forward_cost

        def priced(kind: int, prep: Any, measured_s: float) -> float:
            cost = inner(kind, prep, measured_s)
            self.forward[kind] += cost
            return cost

        setattr(eng, "forward_cost", priced)  # noqa: B010 (an instance attribute shadows the method)
        self.samples: list[Sample] = []
        self._base = 0

    def sample(self) -> None:
        ops: dict[str, float] = {}
        for side in (self.eng.small, self.eng.large):
            for op, s in side.bookkeeping_by_op.items():
                ops[op] = ops.get(op, 0.0) + s
        steps = self.eng.stats.steps
        if not self.samples:  # steps count from the first sample (priming ran steps too)
            self._base = steps
        small_s, large_s = self.forward
        self.samples.append(Sample(steps - self._base, self.eng.now(), small_s, large_s, ops))

    def window(self, last: int) -> tuple[Sample, Sample]:
        """The samples that bracket the last `last` small steps (all of them when fewer):
        from the end of the iteration that ran step (final - last), so a catch-up run on its
        own before the window's first step is in the window, to the end."""
        if len(self.samples) < 2:
            raise ValueError("StepTrace.window: sample before and after the run")
        end = self.samples[-1]
        start = next(s for s in self.samples if s.steps >= end.steps - last)
        return start, end

    def breakdown(self, last: int = 128) -> Breakdown:
        a, b = self.window(last)
        ops = {k: b.ops.get(k, 0.0) - a.ops.get(k, 0.0) for k in {*a.ops, *b.ops}}
        total = b.clock - a.clock
        parts = {"small forward": b.small_s - a.small_s, "large forward": b.large_s - a.large_s}
        for part, names in OPS.items():
            parts[part] = sum(ops.get(n, 0.0) for n in names)
        rest = total - sum(parts.values())
        # The clock is a sum of these terms: a residue within rounding is no time.
        parts["rest"] = 0.0 if abs(rest) <= 1e-9 * max(1.0, abs(total)) else rest
        return Breakdown(b.steps - a.steps, a.steps + 1, total, parts)

    def per_step(self, buckets: int = 64) -> list[list[float]]:
        """The run cut into about `buckets` spans of small steps: per span [first step, last
        step, clock ms per step, tree ms per step] (the tree's cost against depth)."""
        if len(self.samples) < 2:
            return []
        final = self.samples[-1].steps
        width = max(1, math.ceil(final / buckets))
        out: list[list[float]] = []
        prev = self.samples[0]
        for s in self.samples[1:]:
            if s.steps - prev.steps >= width or s is self.samples[-1]:
                n = s.steps - prev.steps
                if n:
                    tree = sum(s.ops.values()) - sum(prev.ops.values())
                    out.append(
                        [prev.steps + 1, s.steps, 1e3 * (s.clock - prev.clock) / n, 1e3 * tree / n]
                    )
                prev = s
        return out


# ---------------------------------------------------------------- summary tables

COMPARED = ("naive", "naive-sglang", "tokencache")
SWEEP_SYSTEMS = ("small alone", "large alone", *COMPARED)


def _by(rows: Sequence[Any], **match: Any) -> dict[str, Any]:
    return {r.system: r for r in rows if all(getattr(r, k) == v for k, v in match.items())}


def _same_clock(x: Any, y: Any) -> bool:
    """Both on one GPU clock profile and mode (a bound's clock names its one model twice), or
    both on the same other clock; threaded rows are wall time, never compared."""
    if x.clock.startswith("gpu:") and y.clock.startswith("gpu:"):
        return bool(x.clock.split(" (")[0] == y.clock.split(" (")[0]) and (
            x.clock.split("; ")[-1] == y.clock.split("; ")[-1]
        )
    return bool(x.clock == y.clock)


def _ratio(x: Any, y: Any) -> str:
    if x is None or y is None or not y.tokens_per_s or not _same_clock(x, y):
        return "-"
    return f"{x.tokens_per_s / y.tokens_per_s:.2f}x"


def sweep_table(rows: Sequence[Any]) -> str:
    """tok/s against concurrency (one table per workload point and rate)."""
    out: list[str] = []
    routed = [r for r in rows if r.system in COMPARED]
    for wl, new, p in sorted({(r.workload, r.max_new, r.p) for r in routed}):
        cs = sorted({r.max_running for r in rows if (r.workload, r.max_new) == (wl, new)})
        out.append(f"\n{wl}, {new} new tokens, p = {p:.2f}: decode tok/s against concurrency\n")
        out.append(
            "| c | small alone | large alone | naive | naive-sglang | tokencache | tc / naive | "
            "tc / naive-sglang | tc / large alone | tc TTFT p50 ms | tc TPOT p50 / p99 ms | "
            "tc ITL p50 / p99 ms |"
        )
        out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for c in cs:
            bounds = _by(rows, workload=wl, max_new=new, max_running=c, p=0.0)
            by = _by(rows, workload=wl, max_new=new, max_running=c, p=p) | {
                k: v for k, v in bounds.items() if k in ("small alone", "large alone")
            }
            cells = [f"{by[s].tokens_per_s:.0f}" if s in by else "-" for s in SWEEP_SYSTEMS]
            tc = by.get("tokencache")
            lat = "-" if tc is None else f"{tc.ttft_p50_ms:.1f}"
            tpot = "-" if tc is None else f"{tc.tpot_p50_ms:.2f} / {tc.tpot_p99_ms:.1f}"
            itl = "-" if tc is None else f"{tc.itl_p50_ms:.2f} / {tc.itl_p99_ms:.1f}"
            ratios = [_ratio(tc, by.get(s)) for s in ("naive", "naive-sglang", "large alone")]
            out.append(f"| {c} | " + " | ".join([*cells, *ratios, lat, tpot, itl]) + " |")
        out.append(
            f"\n{wl}, {new} new tokens, p = {p:.2f}: TTFT p50 / TPOT p50 / TPOT p99 / ITL p99 (ms, "
            "engine clock) against concurrency\n"
        )
        out.append("| c | " + " | ".join(SWEEP_SYSTEMS) + " |")
        out.append("|---:|" + "---:|" * len(SWEEP_SYSTEMS))
        for c in cs:
            by = _by(rows, workload=wl, max_new=new, max_running=c, p=p) | {
                k: v
                for k, v in _by(rows, workload=wl, max_new=new, max_running=c, p=0.0).items()
                if k in ("small alone", "large alone")
            }
            cells = [
                f"{by[s].ttft_p50_ms:.1f} / {by[s].tpot_p50_ms:.2f} / {by[s].tpot_p99_ms:.1f}"
                f" / {by[s].itl_p99_ms:.1f}"
                if s in by
                else "-"
                for s in SWEEP_SYSTEMS
            ]
            out.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def length_table(rows: Sequence[Any]) -> str:
    """tok/s and bookkeeping share against output length (one table per workload, c, rate)."""
    out: list[str] = []
    routed = [r for r in rows if r.system in COMPARED]
    for wl, c, p in sorted({(r.workload, r.max_running, r.p) for r in routed}):
        news = sorted({r.max_new for r in routed if (r.workload, r.max_running) == (wl, c)})
        bounds = [s for s in SWEEP_SYSTEMS[:2] if any(r.system == s for r in rows)]
        systems = [s for s in COMPARED if any(r.system == s for r in rows)]
        out.append(f"\n{wl}, concurrency {c}, p = {p:.2f}: against output length\n")
        out.append(
            "| new tokens | "
            + "".join(f"{s} tok/s | " for s in bounds)
            + " | ".join(f"{s} tok/s | {s} bookkeeping" for s in systems)
            + " | tc / naive | tc / naive-sglang | tc / large alone |"
        )
        out.append("|---:|" + "---:|" * (len(bounds) + 2 * len(systems) + 3))
        for new in news:
            by = _by(rows, workload=wl, max_new=new, max_running=c, p=p) | {
                k: v
                for k, v in _by(rows, workload=wl, max_new=new, max_running=c, p=0.0).items()
                if k in ("small alone", "large alone")
            }
            cells = [f"{by[s].tokens_per_s:.0f}" if s in by else "-" for s in bounds]
            for s in systems:
                r = by.get(s)
                cells += (
                    ["-", "-"]
                    if r is None
                    else [f"{r.tokens_per_s:.0f}", f"{100 * r.bookkeeping_share:.2f}%"]
                )
            tc = by.get("tokencache")
            cells += [_ratio(tc, by.get(s)) for s in ("naive", "naive-sglang", "large alone")]
            out.append(f"| {new} | " + " | ".join(cells) + " |")
        for s in COMPARED:
            pts = sorted(
                (r.max_new, r.bookkeeping_share)
                for r in routed
                if (r.workload, r.max_running, r.p, r.system) == (wl, c, p, s)
            )
            if len(pts) > 1 and pts[0][1]:
                out.append(
                    f"\n{s}: bookkeeping share at {pts[-1][0]} new tokens / at {pts[0][0]}: "
                    f"{pts[-1][1] / pts[0][1]:.2f}x"
                )
    return "\n".join(out)


def breakdown_table(rows: Sequence[Any]) -> str:
    """The published per-step profile beside ours, one table per workload point."""
    out: list[str] = []
    have = [r for r in rows if r.system in COMPARED and r.extra.get("breakdown")]
    for wl, new, c, p in sorted({(r.workload, r.max_new, r.max_running, r.p) for r in have}):
        by = _by(have, workload=wl, max_new=new, max_running=c, p=p)
        systems = [s for s in COMPARED if s in by]
        steps = {by[s].extra["breakdown"]["steps"] for s in systems}
        out.append(
            f"\n{wl}, {new} new tokens, concurrency {c}, p = {p:.2f}: per small step over the "
            f"last {'/'.join(map(str, sorted(steps)))} small steps (ms, share of the step)\n"
        )
        out.append(
            "| part | "
            + " | ".join(f"{s} ms | {s} share" for s in systems)
            + " | paper ms | paper share |"
        )
        out.append("|---|" + "---:|---:|" * len(systems) + "---:|---:|")
        for part in (*PARTS, "step"):
            cells = []
            for s in systems:
                b = by[s].extra["breakdown"]
                if part == "step":
                    cells += [f"{b['step_ms']:.3f}", "100%"]
                else:
                    cells += [f"{b['ms_per_step'][part]:.3f}", f"{100 * b['share'][part]:.1f}%"]
            if part == "step":
                paper = [f"{PAPER_STEP_MS:.2f}", "100%"]
            elif part == "rest":
                rest = PAPER_STEP_MS - sum(PAPER_MS.values())
                paper = [f"{rest:.2f} (derived)", f"{100 * rest / PAPER_STEP_MS:.1f}%"]
            elif part in PAPER_MS:
                paper = [f"{PAPER_MS[part]:.2f}", f"{100 * PAPER_SHARE[part]:.1f}%"]
            else:
                paper = ["-", "-"]
            out.append(f"| {part} | " + " | ".join(cells + paper) + " |")
    return "\n".join(out)
