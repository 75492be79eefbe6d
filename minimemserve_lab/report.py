"""The reports of replayed workloads: gains between two runs' summaries, the comparison
table and its plots, as ``minimemserve bench`` and ``minimemserve sim`` print and write them
(the summaries: ``minimemserve.workloads.results``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

# A config is compared with its context-caching variant named "<config>-CC".
CACHING_SUFFIX = "-CC"
# What a gain or ratio prints as when either side of it is unstable: never a number.
OVERLOADED = "overloaded"


def is_stable(summary: Mapping[str, Any]) -> bool:
    """A summary's stability verdict (one without a record of it counts as stable)."""
    return bool(summary.get("stability", {}).get("stable", True))


def gain(new: Mapping[str, Any], base: Mapping[str, Any], metric: str) -> float | str | None:
    """``new``'s ``metric`` over ``base``'s, minus one: :data:`OVERLOADED` when either run is
    unstable, None when either value is missing."""
    if not (is_stable(new) and is_stable(base)):
        return OVERLOADED
    a, b = new.get(metric), base.get(metric)
    return a / b - 1 if a is not None and b else None


def caching_ratios(
    summaries: Mapping[str, Mapping[str, Any]],
) -> dict[str, float | str | None]:
    """``{"X/X-CC": mean TTFT of later turns under X / under X-CC}`` for every such pair
    (:data:`OVERLOADED` when either run is unstable)."""
    ratios: dict[str, float | str | None] = {}
    for name, base in summaries.items():
        cc = summaries.get(name + CACHING_SUFFIX)
        if cc is None:
            continue
        g = gain(base, cc, "ttft_mean_later")
        ratios[f"{name}/{name}{CACHING_SUFFIX}"] = g + 1 if isinstance(g, float) else g
    return ratios


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def format_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """A plain-text table of the per-config summaries (times in milliseconds)."""
    header = (
        "config",
        "TTFT mean",
        "TTFT P99",
        "TTFT mean t>1",
        "JCT mean",
        "JCT P99",
        "TPOT mean",
        "cached",
        "bytes",
        "errors",
        "stable",
    )
    rows = [header]
    for name, s in summaries.items():
        ratio = s.get("cached_ratio")
        rows.append(
            (
                name,
                _ms(s["ttft_mean"]),
                _ms(s["ttft_p99"]),
                _ms(s["ttft_mean_later"]),
                _ms(s["jct_mean"]),
                _ms(s["jct_p99"]),
                _ms(s["tpot_mean"]),
                "-" if ratio is None else f"{ratio:.1%}",
                f"{s['transferred_bytes']:,}",
                str(s["errors"]),
                "yes" if is_stable(s) else "NO",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "(times in ms)\n" + "\n".join(lines)


# --------------------------------------------------------------------------- plots


def write_plots(
    records_by_config: Mapping[str, list[dict]],
    summaries: Mapping[str, Mapping[str, Any]],
    prefix: Path,
    title: str = "",
) -> list[Path]:
    """Bars of mean/P99 TTFT and JCT per config (an unstable config's hatched and labelled
    overloaded, as its table row says), and CDFs of TTFT and JCT; returns the paths."""
    from matplotlib.figure import Figure  # optional and slow to import: only plots need it

    names = list(summaries)
    stable = [is_stable(summaries[n]) for n in names]
    ticks = [n if ok else f"{n}\n({OVERLOADED})" for n, ok in zip(names, stable)]
    bars = Figure(figsize=(10, 4), layout="tight")
    x = np.arange(len(names))  # [configs]
    width = 0.38
    for ax, metric, name in zip(bars.subplots(1, 2), ("ttft", "jct"), ("TTFT", "JCT")):
        for j, (stat, label) in enumerate((("mean", "mean"), ("p99", "P99"))):
            vals = [(summaries[n][f"{metric}_{stat}"] or 0.0) for n in names]
            drawn = ax.bar(x + (j - 0.5) * width, vals, width, label=label)
            for bar, ok in zip(drawn, stable):
                if not ok:  # an unstable run's times grow with its length: no fair height
                    bar.set_hatch("//")
        ax.set_xticks(x, ticks)
        ax.set_ylabel("seconds")
        ax.set_title(name)
        ax.legend()
    cdfs = Figure(figsize=(10, 4), layout="tight")
    for ax, metric, name in zip(cdfs.subplots(1, 2), ("ttft", "jct"), ("TTFT", "JCT")):
        for n in names:
            vals = np.sort(
                [
                    r[metric]
                    for r in records_by_config[n]
                    if r.get("error") is None and r.get(metric) is not None
                ]
            )
            if len(vals):
                ax.step(vals, np.arange(1, len(vals) + 1) / len(vals), where="post", label=n)
        ax.set_xlabel(f"{name} (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"CDF of {name}")
        ax.legend()
    if title:
        bars.suptitle(title)
        cdfs.suptitle(title)
    paths = [prefix.with_name(f"{prefix.name}_{kind}.png") for kind in ("bars", "cdf")]
    bars.savefig(paths[0], dpi=100)
    cdfs.savefig(paths[1], dpi=100)
    return paths
