"""The serving benchmark's plots: tokens/s against the routing rate (one workload point), and
of long generations tokens/s against concurrency, and tokens/s, bookkeeping share and the
tree's cost per step against output length."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .bench_rows import BOUNDS, LIMITS, SYSTEMS
from .bench_workloads import COMPARED, SWEEP_SYSTEMS

STYLE = {
    "small alone": {"color": "green", "ls": "--"},
    "large alone": {"color": "gray", "ls": "--"},
    "naive": {"color": "tab:orange"},
    "naive-sglang": {"color": "tab:red"},
    "tokencache": {"color": "tab:blue"},
}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('plot skipped: matplotlib is not installed (pip install "./integrations[bench]")')
        return None
    return plt


def _series(rows: Sequence[Any], x: str, **match: Any) -> dict[str, list[tuple[float, Any]]]:
    """Per system, (x, row) sorted by x, over rows matching `match` (bounds at any p)."""
    out: dict[str, list[tuple[float, Any]]] = {}
    for r in rows:
        if r.system not in SWEEP_SYSTEMS:
            continue
        keys = {k: v for k, v in match.items() if not (k == "p" and r.system.endswith("alone"))}
        if all(getattr(r, k) == v for k, v in keys.items()):
            out.setdefault(r.system, []).append((getattr(r, x), r))
    return {s: sorted(v, key=lambda t: t[0]) for s, v in out.items()}


def _log2_ticks(ax: Any, xs: Sequence[float]) -> None:
    """A log2 axis labelled at the values run (1, 4, 8, ... not 2^k)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(xs), [f"{x:g}" for x in xs])
    ax.minorticks_off()


def plot_rates(rows: Sequence[Any], path: Path) -> bool:
    """Decode tok/s against the routing rate p, one panel per context; the bounds as lines."""
    plt = _pyplot()
    if plt is None:
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


def plot_concurrency(rows: Sequence[Any], path: Path) -> bool:
    """Decode tok/s against concurrency, one panel per (workload, new tokens, p)."""
    plt = _pyplot()
    if plt is None:
        return False
    keys = sorted({(r.workload, r.max_new, r.p) for r in rows if r.system in COMPARED})
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.2), squeeze=False)
    for ax, (wl, new, p) in zip(axes[0], keys, strict=True):
        for system, pts in _series(rows, "max_running", workload=wl, max_new=new, p=p).items():
            xs = [x for x, _ in pts]
            ax.plot(xs, [r.tokens_per_s for _, r in pts], marker="o", label=system,
                    **STYLE.get(system, {}))  # fmt: skip
        _log2_ticks(ax, sorted({r.max_running for r in rows if r.system in COMPARED}))
        ax.set_yscale("log")
        ax.set_title(f"{wl}, {new} new tokens, p = {p:g}")
        ax.set_xlabel("concurrency (max_running)")
        ax.set_ylabel("decode tokens/s (engine clock)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_length(rows: Sequence[Any], path: Path) -> bool:
    """Against output length, per (workload, concurrency, p): decode tok/s; bookkeeping share;
    and the trees' ms per small step over the generation of the longest run (depth growth)."""
    plt = _pyplot()
    if plt is None:
        return False
    keys = sorted({(r.workload, r.max_running, r.p) for r in rows if r.system in COMPARED})
    fig, axes = plt.subplots(len(keys), 3, figsize=(17, 4.2 * len(keys)), squeeze=False)
    for ax3, (wl, c, p) in zip(axes, keys, strict=True):
        series = _series(rows, "max_new", workload=wl, max_running=c, p=p)
        for system, pts in series.items():
            xs = [x for x, _ in pts]
            style = STYLE.get(system, {})
            ax3[0].plot(xs, [r.tokens_per_s for _, r in pts], marker="o", label=system, **style)
            if system in COMPARED:
                shares = [100 * r.bookkeeping_share for _, r in pts]
                ax3[1].plot(xs, shares, marker="o", label=system, **style)
                longest = pts[-1][1]
                prof = longest.extra.get("per_step") or []
                if prof:
                    mid = [(a + b) / 2 for a, b, _, _ in prof]
                    ax3[2].plot(mid, [t for _, _, _, t in prof], label=system, **style)
        news = sorted({x for pts in series.values() for x, _ in pts})
        for ax in ax3[:2]:
            _log2_ticks(ax, news)
            ax.set_xlabel("new tokens per request")
        ax3[0].set_yscale("log")
        ax3[0].set_ylabel("decode tokens/s (engine clock)")
        ax3[0].set_title(f"{wl}, concurrency {c}, p = {p:g}")
        ax3[1].set_ylabel("bookkeeping share of the clock (%)")
        ax3[1].set_title("tree time / engine clock")
        ax3[2].set_yscale("log")
        ax3[2].set_xlabel("small step (longest run)")
        ax3[2].set_ylabel("tree ms per small step")
        ax3[2].set_title("tree cost against depth")
        for ax in ax3:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
