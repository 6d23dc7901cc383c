"""Aggregation, table and plot of the peers benchmark (pure functions over result rows).

A row is one replay: `router`, `app`, `rate_scale`, `rep` and the bench-schema metrics,
with `engine_prefix_hit_ratio` from the engines' own counters. Repeated runs of one
(router, app, load) fold into min/median/max, since the machine is shared and noisy.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

# (result key, column title, format) of every metric the table shows.
METRICS: tuple[tuple[str, str, str], ...] = (
    ("goodput_wf_per_s", "goodput wf/s", "{:.3f}"),
    ("deadline_attainment", "attainment", "{:.2f}"),
    ("p95_workflow_s", "P95 wf s", "{:.2f}"),
    ("engine_prefix_hit_ratio", "prefix hits (vLLM)", "{:.2f}"),
)


def prefix_counter_delta(
    before: Sequence[tuple[float, float]], after: Sequence[tuple[float, float]]
) -> tuple[float, float, float | None]:
    """(queried tokens, hit tokens, hit ratio) over all engines between two scrapes of
    vLLM's cumulative `prefix_cache_queries/hits` counters."""
    if len(before) != len(after):
        raise ValueError("before and after must scrape the same engines")
    queries = sum(a[0] - b[0] for b, a in zip(before, after, strict=True))
    hits = sum(a[1] - b[1] for b, a in zip(before, after, strict=True))
    return queries, hits, (hits / queries if queries > 0 else None)


def spread(values: Iterable[float | None]) -> dict[str, float] | None:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals)}


def aggregate(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (router, app, rate_scale), in first-seen order, with min/median/max
    of each metric over the repeated runs."""
    groups: dict[tuple[str, str, float], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["router"], r["app"], float(r["rate_scale"])), []).append(r)
    out = []
    for (router, app, rate), rs in groups.items():
        entry: dict[str, Any] = {"router": router, "app": app, "rate_scale": rate, "runs": len(rs)}
        for key, _, _ in METRICS:
            entry[key] = spread(r.get(key) for r in rs)
        entry["failed_requests"] = sum(int(r.get("failed_requests", 0)) for r in rs)
        out.append(entry)
    return out


def _cell(s: Mapping[str, float] | None, fmt: str) -> str:
    if s is None:
        return "n/a"
    med = fmt.format(s["median"])
    return f"{med} ({fmt.format(s['min'])}..{fmt.format(s['max'])})"


def markdown_table(agg: Sequence[Mapping[str, Any]]) -> str:
    """Median (min..max) per cell; one line per app, load and router."""
    head = ["app", "load", "router", *(title for _, title, _ in METRICS), "runs", "failed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in sorted(agg, key=lambda e: (e["app"], e["rate_scale"])):
        cells = [e["app"], f"x{e['rate_scale']:g}", e["router"]]
        cells += [_cell(e[key], fmt) for key, _, fmt in METRICS]
        cells += [str(e["runs"]), str(e["failed_requests"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sim_table(sim: Sequence[Mapping[str, Any]], real: Sequence[Mapping[str, Any]]) -> str:
    """Simulated baselines' prefix hit ratios beside the real routers they model."""
    real_hits = {
        (e["router"], e["app"], e["rate_scale"]): e["engine_prefix_hit_ratio"] for e in real
    }
    head = [
        "app",
        "load",
        "sim policy",
        "sim prefix hits",
        "real router",
        "real (median)",
        "gap pts",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in sorted(sim, key=lambda s: (s["app"], s["rate_scale"], s["policy"])):
        for router in s["models"]:
            rh = real_hits.get((router, s["app"], s["rate_scale"]))
            med = rh["median"] if rh else None
            gap = "n/a" if med is None else f"{100 * (s['prefix_hit_ratio'] - med):+.1f}"
            lines.append(
                f"| {s['app']} | x{s['rate_scale']:g} | {s['policy']} | "
                f"{s['prefix_hit_ratio']:.2f} | {router} | "
                f"{'n/a' if med is None else f'{med:.2f}'} | {gap} |"
            )
    return "\n".join(lines)


def plot(agg: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """One figure: a column per metric, a row per app; median bars with min..max whiskers,
    grouped by load."""
    import matplotlib

    matplotlib.use("Agg")  # no display here; must precede pyplot
    import matplotlib.pyplot as plt

    apps = sorted({e["app"] for e in agg})
    routers = list(dict.fromkeys(e["router"] for e in agg))
    rates = sorted({e["rate_scale"] for e in agg})
    fig, axes = plt.subplots(
        len(apps), len(METRICS), figsize=(4.2 * len(METRICS), 3.0 * len(apps)), squeeze=False
    )
    width = 0.8 / max(len(routers), 1)
    colors = plt.get_cmap("tab10")
    for i, app in enumerate(apps):
        for j, (key, title, _) in enumerate(METRICS):
            ax = axes[i][j]
            for k, router in enumerate(routers):
                xs, meds, lo, hi = [], [], [], []
                for x, rate in enumerate(rates):
                    e = next(
                        (
                            e
                            for e in agg
                            if e["app"] == app and e["router"] == router and e["rate_scale"] == rate
                        ),
                        None,
                    )
                    if e is None or e[key] is None:
                        continue
                    s = e[key]
                    xs.append(x - 0.4 + width * (k + 0.5))
                    meds.append(s["median"])
                    lo.append(s["median"] - s["min"])
                    hi.append(s["max"] - s["median"])
                ax.bar(
                    xs, meds, width, yerr=[lo, hi], color=colors(k), capsize=2,
                    label=router if i == 0 and j == 0 else None,
                )  # fmt: skip
            ax.set_xticks(range(len(rates)), [f"load x{r:g}" for r in rates])
            ax.set_title(f"{app}: {title}", fontsize=9)
    fig.legend(loc="lower center", ncol=min(len(routers), 6), fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
