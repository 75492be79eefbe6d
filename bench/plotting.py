"""Grouped bar charts for the micro-benchmarks (matplotlib, written as PNG beside the JSON)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def grouped_bars(
    path: str | Path,
    title: str,
    groups: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    ylabel: str,
    log: bool = False,
    hline: float | None = None,
) -> Path:
    """One bar per (group, series); ``series[name][i]`` is the value for ``groups[i]``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(min(12.0, max(6.0, 0.5 * len(groups) * len(series))), 4.5))
    for j, (name, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, [v or 0.0 for v in values], width, label=name)
    ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=1)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
