"""The sweep plot: output throughput and median ITL against max concurrency, one line per label
(serving --sweep-concurrency --plot, compare's docs/img/concurrency-sweep.png)."""

from __future__ import annotations

import os
from typing import Any


def plot_sweep(series: dict[str, list[dict[str, Any]]], path: str, title: str = "") -> None:
    """One PNG: output throughput and median ITL vs max concurrency, one line per label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels: set[int] = set()
    for label, results in series.items():
        pts = sorted(
            (r.get("max_concurrency") or 1, r.get("output_throughput"), r.get("median_itl_ms"))
            for r in results
        )
        if not pts:
            continue
        levels.update(p[0] for p in pts)
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        itl = [p for p in pts if p[2] is not None]  # the HF baseline has no ITL
        if itl:
            ax2.plot([p[0] for p in itl], [p[2] for p in itl], marker="o", label=label)
    for ax, ylabel in ((ax1, "output throughput (tok/s)"), (ax2, "median ITL (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(levels))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("max concurrency (HF: batch size)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
