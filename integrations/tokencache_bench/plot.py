"""Microseconds per hand-off against generated length, log-log, one line per implementation."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tokencache_bench.replay import Timings
from tokencache_extras import require


def plot_handoffs(runs: list[Timings], path: Path, title: str) -> None:
    """Write the plot to ``path``; MissingExtra (naming the bench extra) without matplotlib."""
    matplotlib = require("matplotlib", extra="bench")
    matplotlib.use("Agg")  # files only; CI has no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    seen: set[str] = set()
    for t in runs:
        # One line per implementation: the cursor reference rerun on a sub-trace is skipped.
        if t.name in seen:
            continue
        seen.add(t.name)
        buckets = np.unique(t.buckets)
        xs = [float(np.median(t.gen_len[t.buckets == b])) for b in buckets]
        ys = [float(np.median(t.total_ns[t.buckets == b])) / 1000 for b in buckets]
        ax.plot(xs, ys, marker="o", label=f"{t.name} ({t.requests} req)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("generated tokens L at the hand-off (median of bucket)")
    ax.set_ylabel("median microseconds per hand-off")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # keep lines clear
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
