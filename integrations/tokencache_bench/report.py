"""Turn replay timings into markdown tables (medians, p90, ratios, growth exponents)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokencache_bench.replay import Timings

REFERENCE = "tokencache cursors"


@dataclass
class Memory:
    name: str
    method: str  # "tracemalloc" or "RSS growth"
    bytes_per_token: float
    cached_tokens: int

    def cell(self) -> str:
        # RSS moves in pages and allocators reserve ahead: under 1 MiB of growth says little.
        if self.method == "RSS growth" and self.bytes_per_token * self.cached_tokens < 2**20:
            return f"< {2**20 / self.cached_tokens:,.0f}"
        return f"{self.bytes_per_token:,.0f}"


def _us(ns: float) -> float:
    return ns / 1000.0


def _fmt(us: float) -> str:
    if us >= 100:
        return f"{us:,.0f}"
    if us >= 10:
        return f"{us:.1f}"
    return f"{us:.2f}"


def median_by_bucket(t: Timings) -> dict[int, float]:
    """Median hand-off microseconds per L bucket."""
    total = t.total_ns
    return {int(b): _us(float(np.median(total[t.buckets == b]))) for b in np.unique(t.buckets)}


def growth_exponent(t: Timings) -> float:
    """Slope of log(median hand-off time) against log(generated length), over the buckets."""
    xs, ys = [], []
    for b in np.unique(t.buckets):
        mask = t.buckets == b
        xs.append(np.log(np.median(t.gen_len[mask])))
        ys.append(np.log(np.median(t.total_ns[mask])))
    if len(xs) < 2:
        return float("nan")
    return float(np.polyfit(xs, ys, 1)[0])


def reference_for(t: Timings, runs: list[Timings]) -> Timings | None:
    """The cursor run on the very same trace (same fingerprint), for same-run ratios."""
    for r in runs:
        if r.name == REFERENCE and r.trace_fingerprint == t.trace_fingerprint:
            return r
    return None


def handoff_table(runs: list[Timings]) -> str:
    """Per hand-off median / p90 microseconds by operation and by L bucket."""
    op_cols = ["match", "lock", "insert", "unlock"]
    lines = [
        (
            "| implementation | L bucket | hand-offs | match | lock | insert | unlock "
            "| whole hand-off | x cursors |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in runs:
        ref = reference_for(t, runs)
        ref_med = median_by_bucket(ref) if ref is not None else {}
        for b in np.unique(t.buckets):
            mask = t.buckets == b
            cells = []
            for op in op_cols:
                if op in t.ops:
                    col = t.per_op_ns[mask, t.ops.index(op)]
                    cells.append(
                        f"{_fmt(_us(np.median(col)))} / {_fmt(_us(np.percentile(col, 90)))}"
                    )
                else:
                    cells.append("")
            total = t.total_ns[mask]
            med = _us(float(np.median(total)))
            ratio = f"{med / ref_med[int(b)]:,.1f}" if int(b) in ref_med else "n/a"
            lines.append(
                f"| {t.name} | {b} | {int(mask.sum())} | "
                + " | ".join(cells)
                + f" | {_fmt(med)} / {_fmt(_us(np.percentile(total, 90)))} | {ratio} |"
            )
    return "\n".join(lines)


def summary_table(runs: list[Timings], memory: dict[str, dict[str, Memory]]) -> str:
    buckets = sorted({int(b) for t in runs for b in np.unique(t.buckets)})
    head = " | ".join(f"L<={b}" for b in buckets)
    lines = [
        (
            f"| implementation | requests | {head} | growth exponent "
            f"| x cursors at L<={buckets[-1]} | RSS bytes / token | tracemalloc bytes / token |"
        ),
        "|---|---:|" + "---:|" * len(buckets) + "---:|---:|---:|---:|",
    ]
    for t in runs:
        med = median_by_bucket(t)
        ref = reference_for(t, runs)
        last = buckets[-1]
        ratio = (
            f"{med[last] / median_by_bucket(ref)[last]:,.1f}"
            if ref is not None and last in med
            else "n/a"
        )
        mem_cells = []
        for kind in ("rss", "tracemalloc"):
            mem = memory.get(kind, {}).get(t.name)
            mem_cells.append(mem.cell() if mem else "")
        cells = " | ".join(_fmt(med[b]) if b in med else "" for b in buckets)
        lines.append(
            f"| {t.name} | {t.requests} | {cells} | {growth_exponent(t):.2f} | {ratio} "
            f"| {' | '.join(mem_cells)} |"
        )
    return "\n".join(lines)


def step_median(t: Timings, bucket: int) -> float:
    """Median microseconds over the bucket's steps that have hand-offs (the others cost 0)."""
    busy = t.step_ns[(t.step_buckets == bucket) & (t.step_ns > 0)]
    return _us(float(np.median(busy))) if len(busy) else 0.0


def step_table(step_runs: dict[int, list[Timings]]) -> str:
    """Cache microseconds per decode step, by batch size and L bucket."""
    lines = [
        "| batch | implementation | L bucket | steps with hand-offs | median per such step "
        "| mean per decode step | x extend_many (medians) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for batch, runs in step_runs.items():
        ref = next((r for r in runs if r.name.endswith("extend_many")), None)
        for t in runs:
            for b in np.unique(t.step_buckets):
                mask = t.step_buckets == b
                med = step_median(t, int(b))
                mean = _us(float(t.step_ns[mask].mean()))
                ref_med = step_median(ref, int(b)) if ref is not None else 0.0
                ratio = f"{med / ref_med:,.1f}" if ref_med > 0 else "n/a"
                lines.append(
                    f"| {batch} | {t.name} | {b} | {int((t.step_ns[mask] > 0).sum())} "
                    f"| {_fmt(med)} | {_fmt(mean)} | {ratio} |"
                )
    return "\n".join(lines)


def verification_table(runs: list[Timings]) -> str:
    lines = [
        "| implementation | trace | requests | hand-offs | cached tokens | expected | wall s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for t in runs:
        lines.append(
            f"| {t.name} | {t.trace_fingerprint} | {t.requests} | {len(t.buckets)} "
            f"| {t.cached_tokens} | {t.expected_tokens} | {t.wall_s:.1f} |"
        )
    return "\n".join(lines)


def verify(runs: list[Timings]) -> None:
    """Every run on one trace must end with the same cached token count, the trace's own."""
    by_trace: dict[str, set[int]] = {}
    for t in runs:
        by_trace.setdefault(t.trace_fingerprint, set()).add(t.cached_tokens)
        assert t.cached_tokens == t.expected_tokens, (
            f"{t.name} cached {t.cached_tokens} tokens, the trace holds {t.expected_tokens}"
        )
    for fingerprint, counts in by_trace.items():
        assert len(counts) == 1, f"trace {fingerprint}: implementations disagree: {counts}"
