"""Tables and plots of `results.json`."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

COLUMNS = [
    ("policy", "policy", "{}"),
    ("rate_scale", "rate", "{:.3g}"),
    ("goodput_wf_per_s", "goodput/s", "{:.3f}"),
    ("deadline_attainment", "attain", "{:.3f}"),
    ("p50_workflow_s", "p50 wf s", "{:.2f}"),
    ("p95_workflow_s", "p95 wf s", "{:.2f}"),
    ("p95_ttft_s", "p95 ttft s", "{:.3f}"),
    ("prefix_hit_ratio", "hit", "{:.3f}"),
    ("decision_p99_us", "dec p99 us", "{:.1f}"),
]


def table(results: dict[str, Any], include_sweep: bool = False) -> str:
    lines: list[str] = []
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    every = [*results["runs"], *results.get("cut_short_runs", [])]
    every.sort(key=lambda r: (r["trace"], r["policy"], r["rate_scale"]))
    for r in every:
        if include_sweep or not r.get("sweep"):
            by_trace[r["trace"]].append(r)
    for trace, rows in by_trace.items():
        lines.append(f"== {trace}")
        header = [c[1] for c in COLUMNS]
        # (a sweep probe cut short has no metrics: its row shows its rate and "cut")
        body = [[fmt.format(r[k]) if k in r else "cut" for k, _, fmt in COLUMNS] for r in rows]
        widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
        lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
        for b in body:
            lines.append("  ".join(v.ljust(w) for v, w in zip(b, widths, strict=True)))
    cap = results.get("capacity")
    if cap:
        lines.append("== capacity (highest rate scale with attainment >= 0.9)")
        for trace, pol in cap.items():
            lines.append(f"{trace}: " + ", ".join(f"{p}={v:.3g}" for p, v in pol.items()))
    return "\n".join(lines)


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_DASHES = ("--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))


def plot_results(results: dict[str, Any], out: Path) -> list[Path]:
    """goodput.png and p95_latency.png: one panel per trace, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results["runs"] if not r.get("sweep")] or results["runs"]
    runs = [r for r in runs if not r.get("cut_short")]  # no metrics to draw
    traces = sorted({r["trace"] for r in runs})
    written: list[Path] = []
    for metric, label, fname in (
        ("goodput_wf_per_s", "goodput (workflows/s within deadline)", "goodput.png"),
        ("p95_workflow_s", "P95 workflow latency (s)", "p95_latency.png"),
    ):
        fig, axes = plt.subplots(1, len(traces), figsize=(4.5 * len(traces), 3.6), squeeze=False)
        for ax, trace in zip(axes[0], traces, strict=True):
            series: dict[str, list[tuple[float, float]]] = defaultdict(list)
            for r in runs:
                if r["trace"] == trace:
                    series[r["policy"]].append((r["rate_scale"], r[metric]))
            for i, (pol, pts) in enumerate(sorted(series.items())):
                pts.sort()
                # Policies often coincide at low load: each gets its own marker, dash and
                # colour, and wasma is drawn last and thicker, so every line stays visible.
                own = pol == "wasma"
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker=_MARKERS[i % len(_MARKERS)],
                    linestyle="-" if own else _DASHES[i % len(_DASHES)],
                    linewidth=2.4 if own else 1.3,
                    markersize=6 if own else 5,
                    color="black" if own else plt.get_cmap("tab10")(i % 10),
                    alpha=1.0 if own else 0.85,
                    zorder=3 if own else 2,
                    label=pol,
                )
            ax.set_title(trace)
            ax.set_xlabel("arrival-rate scale")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
