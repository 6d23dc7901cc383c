"""The KV tier benchmark: capacity and prefix hits with and without a CPU KV tier.

For the Mooncake trace (imported, a slice of its first requests) and the multi-agent
apps, on each engine count: a capacity sweep of every policy with no CPU tier and with a
CPU tier of `--gib` GiB on every engine (peers get the same tier), the prefix-hit ratio
at each policy's capacity against the unbounded-cache ceiling
(`metrics.prefix_hit_ceiling`), and an ablation of wasma's tier mechanisms. Writes
DIR/kv_tier.json, DIR/kv_tier.md and DIR/kv_tier.png.

    python -m wasma.benchmarks.studies.kv_tier \
        --mooncake ../shared/traces/mooncake_synthetic.jsonl \
        --requests 1000 --engines 8 --out out/kv-tier
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from wasma.benchmarks.apps import generate
from wasma.benchmarks.bench import bench
from wasma.benchmarks.metrics import prefix_hit_ceiling
from wasma.benchmarks.trace_io import read_mooncake, to_workflows
from wasma.core.profile import load_profile
from wasma.scheduler.trace import load_trace, write_trace

POLICIES = ("least_loaded", "prefix_aware", "kv_aware", "wasma")
KV_ROUTERS = ("prefix_aware", "kv_aware")
# wasma with one tier mechanism off at a time (as registered policy parameters).
ABLATIONS: dict[str, dict[str, Any]] = {
    "no_cpu_pricing": {"cpu_tier": False},
    "no_prefetch": {"prefetch": False},
    "no_retention": {"retain": False},
}


def _at_capacity(runs: list[dict[str, Any]], trace: str, policy: str, scale: float) -> float:
    """The prefix-hit ratio of the sweep's run at the capacity scale (the highest passing
    one); if none passed, the lowest-rate run that ran to its end (a probe cut short has
    no metrics), 0 if every one was cut."""
    rows = [
        r for r in runs if r["trace"] == trace and r["policy"] == policy and not r.get("cut_short")
    ]
    at = [r for r in rows if r["rate_scale"] == scale] or sorted(
        rows, key=lambda r: r["rate_scale"]
    )[:1]
    return float(at[0]["prefix_hit_ratio"]) if at else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mooncake", required=True, help="a Mooncake trace (JSONL)")
    ap.add_argument(
        "--requests", type=int, default=1000, help="its first N requests (0: all of them)"
    )
    ap.add_argument("--apps", default="mapreduce,debate")
    ap.add_argument("--app-workflows", type=int, default=150)
    ap.add_argument("--engines", default="8", help="comma-separated engine counts")
    ap.add_argument("--gib", type=float, default=200.0, help="CPU tier per engine")
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--ablation", action="store_true", help="wasma ablation (8 engines)")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = load_profile(args.profile)
    traces: list[str] = []
    reqs = read_mooncake(args.mooncake)
    reqs = reqs[: args.requests] if args.requests else reqs
    wfs, _dropped = to_workflows(reqs, profile)
    path = out / f"mooncake_{args.requests}.jsonl"
    write_trace(path, wfs)
    traces.append(str(path))
    for app in [a for a in args.apps.split(",") if a]:
        path = out / f"{app}.jsonl"
        write_trace(path, generate(app, args.app_workflows, 1.0, seed=7, profile=profile))
        traces.append(str(path))
    ceiling = {Path(t).name: prefix_hit_ceiling(load_trace(t), profile.block_size) for t in traces}
    cells: list[dict[str, Any]] = []
    for n in [int(x) for x in args.engines.split(",")]:
        for gib in (0.0, args.gib):
            res = bench(
                traces,
                list(POLICIES),
                n,
                args.profile,
                None,
                True,
                str(out / f"e{n}_cpu{gib:g}"),
                workers=args.workers,
                show_progress=False,
                cpu_tier_gib=gib,
            )
            for trace, caps in res["capacity"].items():
                for pol, cap in caps.items():
                    cells.append(
                        {
                            "trace": trace,
                            "engines": n,
                            "cpu_tier_gib": gib,
                            "policy": pol,
                            "capacity": cap,
                            "prefix_hit_ratio": _at_capacity(res["runs"], trace, pol, cap),
                        }
                    )
            print(json.dumps([c for c in cells if c["engines"] == n and c["cpu_tier_gib"] == gib]))
    ablation: list[dict[str, Any]] = []
    if args.ablation:
        for name, params in ABLATIONS.items():
            res = bench(
                traces,
                ["wasma"],
                8,
                args.profile,
                None,
                True,
                str(out / f"ablation_{name}"),
                workers=args.workers,
                params={"wasma": params},
                show_progress=False,
                cpu_tier_gib=args.gib,
            )
            for trace, caps in res["capacity"].items():
                cap = caps["wasma"]
                ablation.append(
                    {
                        "trace": trace,
                        "variant": name,
                        "capacity": cap,
                        "prefix_hit_ratio": _at_capacity(res["runs"], trace, "wasma", cap),
                    }
                )
    result = {"ceiling": ceiling, "cells": cells, "ablation": ablation, "gib": args.gib}
    (out / "kv_tier.json").write_text(json.dumps(result, indent=2))
    (out / "kv_tier.md").write_text(report(result))
    plot(result, out / "kv_tier.png")
    print(report(result))


def report(result: dict[str, Any]) -> str:
    cells = result["cells"]
    ceiling = result["ceiling"]
    lines = [
        "| trace | engines | CPU tier | " + " | ".join(POLICIES) + " | wasma / least_loaded"
        " | wasma / best KV router | wasma hit / ceiling |",
        "|---|---|---|" + "---|" * (len(POLICIES) + 3),
    ]
    keys = sorted({(c["trace"], c["engines"], c["cpu_tier_gib"]) for c in cells})
    for trace, n, gib in keys:
        row = {
            c["policy"]: c
            for c in cells
            if (c["trace"], c["engines"], c["cpu_tier_gib"]) == (trace, n, gib)
        }
        caps = {p: row[p]["capacity"] for p in row}
        best_kv = max(caps.get(p, 0.0) for p in KV_ROUTERS)
        w = caps.get("wasma", 0.0)
        vs_ll = w / caps["least_loaded"] if caps.get("least_loaded") else float("nan")
        vs_kv = w / best_kv if best_kv else float("nan")
        ceil = ceiling.get(trace, 0.0)
        hit = row["wasma"]["prefix_hit_ratio"] if "wasma" in row else 0.0
        cols = " | ".join(
            f"{caps[p]:.2f} ({row[p]['prefix_hit_ratio']:.2f})" if p in row else "-"
            for p in POLICIES
        )
        tier = f"{gib:g} GiB" if gib else "none"
        lines.append(
            f"| {trace} | {n} | {tier} | {cols} | {vs_ll:.2f}x | {vs_kv:.2f}x | "
            f"{hit / ceil if ceil else float('nan'):.2f} (ceiling {ceil:.3f}) |"
        )
    text = (
        "Capacity (highest rate scale with deadline attainment >= 0.9) and, in brackets, "
        "the prefix-hit ratio at that rate.\n\n" + "\n".join(lines) + "\n"
    )
    if result["ablation"]:
        text += "\n| trace | wasma variant (CPU tier on) | capacity | prefix-hit ratio |\n"
        text += "|---|---|---|---|\n"
        for trace in sorted({a["trace"] for a in result["ablation"]}):
            full = [
                c
                for c in cells
                if c["trace"] == trace
                and c["policy"] == "wasma"
                and c["engines"] == 8
                and c["cpu_tier_gib"] > 0
            ]
            if full:
                text += f"| {trace} | all on | {full[0]['capacity']:.2f} | "
                text += f"{full[0]['prefix_hit_ratio']:.3f} |\n"
            for a in result["ablation"]:
                if a["trace"] == trace:
                    text += f"| {trace} | {a['variant']} | {a['capacity']:.2f} | "
                    text += f"{a['prefix_hit_ratio']:.3f} |\n"
    return text


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    groups = sorted({(c["trace"], c["engines"]) for c in cells})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), squeeze=False)
    for ax, (trace, n) in zip(axes[0], groups, strict=True):
        for k, gib in enumerate(sorted({c["cpu_tier_gib"] for c in cells})):
            caps = [
                next(
                    (
                        c["capacity"]
                        for c in cells
                        if (c["trace"], c["engines"], c["cpu_tier_gib"], c["policy"])
                        == (trace, n, gib, p)
                    ),
                    0.0,
                )
                for p in POLICIES
            ]
            xs = [i + 0.4 * k for i in range(len(POLICIES))]
            label = f"CPU tier {gib:g} GiB" if gib else "GPU only"
            ax.bar(xs, caps, width=0.4, label=label)
        ax.set_xticks([i + 0.2 for i in range(len(POLICIES))], POLICIES, rotation=20)
        ax.set_title(f"{trace}, {n} engines", fontsize=9)
        ax.set_ylabel("capacity (rate scale)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
