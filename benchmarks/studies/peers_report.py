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
# Folded like METRICS but not a column of the main table: the targets table reads them.
EXTRA_METRICS: tuple[str, ...] = ("duration_s",)


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


def run_line(row: Mapping[str, Any], router_width: int) -> str:
    """One finished run as the studies print it while they go."""
    return (
        f"{row['router']:<{router_width}} {row['app']:<9} x{row['rate_scale']:<4g} "
        f"goodput {row['goodput_wf_per_s']:.3f} "
        f"attain {row['deadline_attainment']:.2f} "
        f"p95 {row['p95_workflow_s']:.2f}s "
        f"hits {row['engine_prefix_hit_ratio'] or 0:.2f} "
        f"failed {row['failed_requests']}"
    )


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
        for key in (*(k for k, _, _ in METRICS), *EXTRA_METRICS):
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


def _median(e: Mapping[str, Any], key: str) -> float | None:
    s = e.get(key)
    return None if s is None else float(s["median"])


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _peers(entries: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The peer routers' entries: every router not named wasma (ablations and `[base]`
    twins included)."""
    return [e for e in entries if not e["router"].startswith("wasma")]


def _best_and_fastest(
    peers: Sequence[Mapping[str, Any]],
) -> tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]:
    """The peer with the highest median goodput and the one with the lowest median P95
    (None where no peer has that metric)."""
    rated = [e for e in peers if _median(e, "goodput_wf_per_s") is not None]
    timed = [e for e in peers if _median(e, "p95_workflow_s") is not None]
    best = max(rated, key=lambda e: _median(e, "goodput_wf_per_s") or 0.0, default=None)
    fastest = min(timed, key=lambda e: _median(e, "p95_workflow_s") or 0.0, default=None)
    return best, fastest


def targets_table(agg: Sequence[Mapping[str, Any]], subject: str = "wasma") -> str:
    """`subject` against the peers (every router not named wasma...) at each app and load.

    "Best peer" has the highest median goodput; P95 is against the lowest peer P95.
    Goodput is workflows that met their deadline over the run's duration (first arrival
    to last finish), so the goodput ratio splits into an attainment factor (subject's
    attainment over the best peer's, at most 1 / the peer's attainment) and a duration
    factor (the peer's duration over the subject's: who finished the same arrivals
    sooner). The two are ratios of medians, so their product is close to, not equal to,
    the ratio of median goodputs."""
    head = [
        "app",
        "load",
        "best peer (goodput)",
        "its attainment",
        f"{subject} goodput / best peer",
        "= attainment factor",
        "x duration factor",
        f"{subject} P95 / lowest peer P95",
        "runs",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cells: dict[tuple[str, float], list[Mapping[str, Any]]] = {}
    for e in agg:
        cells.setdefault((e["app"], e["rate_scale"]), []).append(e)

    def fmt(x: float | None, f: str = "{:.2f}x") -> str:
        return "n/a" if x is None else f.format(x)

    for (app, rate), es in sorted(cells.items()):
        mine = next((e for e in es if e["router"] == subject), None)
        best, fastest = _best_and_fastest(_peers(es))
        if mine is None or best is None:
            continue
        att_peer = _median(best, "deadline_attainment")
        p95 = "n/a"
        if fastest is not None:
            ratio = _ratio(_median(mine, "p95_workflow_s"), _median(fastest, "p95_workflow_s"))
            p95 = (
                f"{fmt(ratio)} ({fastest['router']} {_median(fastest, 'p95_workflow_s'):.2f} s; "
                f"{subject} {fmt(_median(mine, 'p95_workflow_s'), '{:.2f} s')})"
            )
        lines.append(
            "| "
            + " | ".join(
                [
                    app,
                    f"x{rate:g}",
                    f"{best['router']} {_median(best, 'goodput_wf_per_s'):.3f}",
                    fmt(att_peer, "{:.2f}"),
                    fmt(
                        _ratio(_median(mine, "goodput_wf_per_s"), _median(best, "goodput_wf_per_s"))
                    ),
                    fmt(_ratio(_median(mine, "deadline_attainment"), att_peer)),
                    fmt(_ratio(_median(best, "duration_s"), _median(mine, "duration_s"))),
                    p95,
                    str(min(mine["runs"], best["runs"])),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def capacity_table(
    agg: Sequence[Mapping[str, Any]], subject: str = "wasma", threshold: float = 0.9
) -> str:
    """Per app: the highest load at which a peer still meets `threshold` of deadlines
    (median over runs), `subject`'s ratios there, and `subject`'s own highest such load.

    On a noisy box attainment is not monotone in load, so "the load where the best peer
    attains 90%" is read as the highest tested load where any peer does: the most
    generous reading for the peers. Loads below it where no peer did are listed, so a
    dip is visible rather than hidden. A capacity ratio whose subject met the threshold
    at the highest load tested is a lower bound (shown with >=). Where the subject itself
    dips below the threshold under its own highest such load, the ratio is given as a
    range: from its last load before the first dip (the strict reading) to its highest
    (the generous one the peers get)."""
    head = [
        "app",
        "peers' 90% point (best peer there)",
        "dips below it",
        f"{subject} goodput / best peer",
        f"{subject} P95 / lowest peer P95",
        f"{subject}'s own highest load >= {threshold:g}",
        f"{subject}'s dips below it",
        "capacity ratio",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    apps = sorted({e["app"] for e in agg})
    for app in apps:
        by_load: dict[float, list[Mapping[str, Any]]] = {}
        for e in agg:
            if e["app"] == app:
                by_load.setdefault(e["rate_scale"], []).append(e)
        loads = sorted(by_load)
        peer_best: dict[float, tuple[float, Mapping[str, Any]]] = {}
        mine_of: dict[float, Mapping[str, Any]] = {}
        mine_att: dict[float, float] = {}
        for load in loads:
            rated = [
                (a, e)
                for e in _peers(by_load[load])
                if (a := _median(e, "deadline_attainment")) is not None
            ]
            if rated:
                peer_best[load] = max(rated, key=lambda ae: ae[0])
            mine = next((e for e in by_load[load] if e["router"] == subject), None)
            if mine is not None:
                mine_of[load] = mine
                if (a := _median(mine, "deadline_attainment")) is not None:
                    mine_att[load] = a
        met = [x for x in loads if x in peer_best and peer_best[x][0] >= threshold]
        if not met or not mine_att:
            continue
        point = met[-1]
        dips = [x for x in loads if x < point and x in peer_best and x not in met]
        mine = mine_of.get(point)
        best, fastest = _best_and_fastest(_peers(by_load[point]))
        good = p95 = "n/a"
        if mine is not None and best is not None:
            g = _ratio(_median(mine, "goodput_wf_per_s"), _median(best, "goodput_wf_per_s"))
            good = "n/a" if g is None else f"{g:.2f}x ({best['router']})"
        if mine is not None and fastest is not None:
            p = _ratio(_median(mine, "p95_workflow_s"), _median(fastest, "p95_workflow_s"))
            p95 = "n/a" if p is None else f"{p:.2f}x ({fastest['router']})"
        own = [x for x in loads if mine_att.get(x, 0.0) >= threshold]
        own_point = own[-1] if own else None
        below = [(x, a) for x, a in mine_att.items() if own_point is not None and x < own_point]
        own_dips = [x for x, a in below if a < threshold]
        if own_point is None:
            ratio = "n/a"
        else:
            bound = ">= " if own_point == loads[-1] else ""
            ratio = f"{bound}{own_point / point:.2f}x"
            steady = [x for x in own if not own_dips or x < own_dips[0]]
            if own_dips:
                low = f"{steady[-1] / point:.2f}x" if steady else "none"
                ratio = f"{low} .. {ratio}"
        lines.append(
            "| "
            + " | ".join(
                [
                    app,
                    f"x{point:g} ({peer_best[point][1]['router']} {peer_best[point][0]:.2f})",
                    ", ".join(f"x{x:g} ({peer_best[x][0]:.2f})" for x in dips) or "none",
                    good,
                    p95,
                    "none" if own_point is None else f"x{own_point:g}",
                    ", ".join(f"x{x:g} ({mine_att[x]:.2f})" for x in own_dips) or "none",
                    ratio,
                ]
            )
            + " |"
        )
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
    # Wider panels when many loads are pooled, so the groups of bars stay readable.
    panel_w = max(4.2, 0.55 * len(rates))
    fig, axes = plt.subplots(
        len(apps), len(METRICS), figsize=(panel_w * len(METRICS), 3.0 * len(apps)), squeeze=False
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
            ax.set_xticks(range(len(rates)), [f"x{r:g}" for r in rates], fontsize=8)
            if i == len(apps) - 1:
                ax.set_xlabel("load (x the trace's rate)", fontsize=8)
            ax.set_title(f"{app}: {title}", fontsize=9)
    fig.legend(loc="lower center", ncol=min(len(routers), 6), fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
