"""The routing benchmark's report: the clock line (what the clock charged, the launch policy,
the arrivals, the chunk budgets), one Markdown table per workload and concurrency, then the
sweeps' summaries and the per-step breakdown."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .bench_rows import BOUNDS, SYSTEMS, Row, point
from .bench_workloads import Workload, breakdown_table, length_table, sweep_table

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
