"""How far the policy's targets depend on the trace: `make bench`'s target cells on
several trace seeds.

    python -m wasma.benchmarks.studies.target_seeds  # seeds 7-11, three apps
    python -m wasma.benchmarks.studies.target_seeds --seeds 7,8 --apps debate
    python -m wasma.benchmarks.studies.target_seeds --param wasma.admission_bias=true --out DIR

`make bench` measures each target on one trace an app (seed 7). The cells at and above
least_loaded's knee sit where a workflow more or less meeting its deadline moves
attainment, and with it the capacity bisection and the P95. One trace cannot say whether
a ratio next to its target is a property of the policy or of that trace. Here every seed
gets a trace of each app (same generator, same size and deadlines as `make bench`), and
on each: capacity sweeps of least_loaded, prefix_aware, kv_aware and wasma, then
least_loaded and wasma at 1x, 1.5x and 2x least_loaded's capacity on that trace.

Writes DIR/results.json (every run, tagged with its app and seed), DIR/summary.md (each
target: its value on every seed, median, range, and how many seeds meet it) and
DIR/seeds.png (the same, one dot a seed, the target as a dashed line). `--report-only`
writes the summary and plot again from DIR/results.json.

A goodput ratio is unbounded where least_loaded met no deadline, and a capacity ratio
where neither KV-aware peer met 90% at any load (`inf` in the summary, null in
results.json). A capacity comes from the sweep's bisection, which stops when
the bracket is within 3%, so a capacity ratio is known to about that much.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from wasma.benchmarks.apps import app_specs, generate
from wasma.benchmarks.bench import Runner, RunSpec, sweep_capacity
from wasma.benchmarks.metrics import prefix_hit_ceiling
from wasma.benchmarks.studies.targets import SWEPT
from wasma.core.profile import load_profile
from wasma.deploy.cli import CLIError, check_params, parse_params
from wasma.scheduler.trace import load_trace, write_trace

MULTS = (1.0, 1.5, 2.0)
# The targets of the policy (README, "Results: the wasma policy in simulation").
P95_MAX = 0.52  # wasma P95 / least_loaded P95, at every multiple of the knee
GOODPUT_MIN = 2.07  # wasma goodput / least_loaded goodput, at 2x the knee
CAPACITY_MIN = 1.3  # wasma capacity / the best of prefix_aware and kv_aware


@dataclass(frozen=True)
class Target:
    """One target on one app: the ratio per seed and the bound it must meet."""

    app: str
    label: str
    bound: float
    upper: bool  # True: the ratio must be <= bound; False: >= bound
    values: dict[int, float]

    def met(self, value: float) -> bool:
        return value <= self.bound if self.upper else value >= self.bound


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not vals or len(set(vals)) != len(vals):
        raise SystemExit(f"{flag}: expected distinct integers, got {text!r}")
    return vals


def targets(
    runs: list[dict[str, Any]], capacity: dict[tuple[str, int], dict[str, float]]
) -> list[Target]:
    """The targets' ratios per (app, seed), from the runs and the sweeps' capacities."""
    cells: dict[tuple[str, int, float, str], dict[str, Any]] = {}
    for r in runs:
        if not r.get("sweep"):
            cells[(r["app"], r["seed"], r["load"], r["policy"])] = r
    order = list(app_specs())
    apps = sorted({app for app, _seed in capacity}, key=order.index)
    seeds = sorted({seed for _app, seed in capacity})
    out: list[Target] = []
    for app in apps:
        for mult in MULTS:
            p95 = {}
            for seed in seeds:
                ll = cells.get((app, seed, mult, "least_loaded"))
                wa = cells.get((app, seed, mult, "wasma"))
                if ll and wa:
                    p95[seed] = wa["p95_workflow_s"] / ll["p95_workflow_s"]
            out.append(Target(app, f"P95 / LL at {mult:g}x", P95_MAX, True, p95))
        goodput = {}
        for seed in seeds:
            ll = cells.get((app, seed, 2.0, "least_loaded"))
            wa = cells.get((app, seed, 2.0, "wasma"))
            if ll and wa:
                # least_loaded meeting no deadline at all makes the ratio unbounded.
                base = ll["goodput_wf_per_s"]
                goodput[seed] = wa["goodput_wf_per_s"] / base if base > 0 else math.inf
        out.append(Target(app, "goodput / LL at 2x", GOODPUT_MIN, False, goodput))
        cap = {}
        for seed in seeds:
            c = capacity.get((app, seed))
            if c:
                # Neither peer meeting 90% at any load makes the ratio unbounded too.
                peer = max(c["prefix_aware"], c["kv_aware"])
                cap[seed] = c["wasma"] / peer if peer > 0 else math.inf
        out.append(Target(app, "capacity / best KV peer", CAPACITY_MIN, False, cap))
    return out


def _fmt(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.3f}"


def summary_markdown(found: list[Target], seeds: list[int]) -> str:
    head = ["app", "target", *(f"seed {s}" for s in seeds), "median", "range", "seeds met"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in found:
        vals = list(t.values.values())
        bound = f"{'<=' if t.upper else '>='} {t.bound:g}"
        row = [t.app, f"{t.label} ({bound})"]
        row += [_fmt(t.values[s]) if s in t.values else "-" for s in seeds]
        if vals:
            row += [
                _fmt(statistics.median(vals)),
                f"{_fmt(min(vals))}-{_fmt(max(vals))}",
                f"{sum(t.met(v) for v in vals)}/{len(vals)}",
            ]
        else:
            row += ["-", "-", "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def ceiling_markdown(
    runs: list[dict[str, Any]], ceilings: dict[tuple[str, int], float], seeds: list[int]
) -> str:
    """wasma's prefix hit ratio at 1x the knee beside the trace's ceiling, per seed."""
    hit = {
        (r["app"], r["seed"]): r["prefix_hit_ratio"]
        for r in runs
        if not r.get("sweep") and r["policy"] == "wasma" and r["load"] == 1.0
    }
    head = ["app", *(f"seed {s}" for s in seeds)]
    lines = [
        "Prefix hit ratio: wasma at 1x / the trace's ceiling (one infinite cache shared by "
        "all engines)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    order = list(app_specs())
    for app in sorted({a for a, _s in ceilings}, key=order.index):
        cells = [
            f"{hit[(app, s)]:.3f} / {ceilings[(app, s)]:.3f}"
            if (app, s) in hit and (app, s) in ceilings
            else "-"
            for s in seeds
        ]
        lines.append("| " + " | ".join([app, *cells]) + " |")
    return "\n".join(lines)


def plot(found: list[Target], out: Path) -> Path:
    """One panel a kind of target: a dot a seed for each app (and load), the target as a
    dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ("P95", "goodput", "capacity")
    fig, axes = plt.subplots(1, len(kinds), figsize=(15, 4.2))
    for ax, kind in zip(axes, kinds, strict=True):
        mine = [t for t in found if t.label.startswith(kind)]
        for x, t in enumerate(mine):
            ys = [v for v in t.values.values() if not math.isinf(v)]
            ax.scatter([x] * len(ys), ys, s=22, alpha=0.75)
            mid = statistics.median(t.values.values()) if t.values else math.inf
            if not math.isinf(mid):
                ax.hlines(mid, x - 0.3, x + 0.3, color="black", lw=1)
            unbounded = len(t.values) - len(ys)
            if unbounded:
                # A ratio over a baseline that met no deadline has no place on the axis.
                ax.annotate(
                    f"+{unbounded} inf",
                    (x, 1),
                    xycoords=("data", "axes fraction"),
                    xytext=(0, -12),
                    textcoords="offset points",
                    ha="center",
                    fontsize=7,
                )
        if mine:
            ax.axhline(mine[0].bound, color="tab:red", ls="--", lw=1, label="target")
        ax.set_xticks(range(len(mine)))
        ax.set_xticklabels(
            [f"{t.app}\n{t.label.rsplit(' at ', 1)[-1]}" if kind == "P95" else t.app for t in mine],
            fontsize=8,
            rotation=30 if kind == "P95" else 0,
        )
        if kind == "goodput":
            ax.set_yscale("log")
        ax.set_title(mine[0].label.split(" at ")[0] if mine else kind, fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("wasma targets on each trace seed (dot = seed, bar = median)", fontsize=11)
    fig.tight_layout()
    path = out / "seeds.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="out/bench-seeds")
    ap.add_argument("--seeds", default="7,8,9,10,11", help="trace seeds (make bench uses 7)")
    ap.add_argument("--apps", default="pipeline,mapreduce,debate")
    ap.add_argument("--workflows", type=int, default=400)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--address", default=None, help="Ray address to run the grid on")
    ap.add_argument("--report-only", action="store_true", help="summary and plot from DIR")
    ap.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="POLICY.KEY=VALUE",
        help="a policy parameter for every run of that policy (repeatable)",
    )
    args = ap.parse_args(argv)
    if args.report_only:
        return report(Path(args.out))
    seeds = _ints(args.seeds, "--seeds")
    try:
        params = parse_params(args.param)
        check_params(SWEPT, params, load_profile(args.profile))
    except CLIError as exc:
        raise SystemExit(str(exc)) from None
    if set(params) - set(SWEPT):
        raise SystemExit(f"--param: no runs of {sorted(set(params) - set(SWEPT))} here")
    apps = [a.strip() for a in args.apps.split(",") if a.strip()]
    unknown = [a for a in apps if a not in app_specs()]
    if not apps or unknown:
        raise SystemExit(f"--apps: unknown {unknown or apps}; choose from {', '.join(app_specs())}")
    if args.workflows <= 0 or args.engines <= 0:
        raise SystemExit("--workflows and --engines must be positive")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = load_profile(args.profile)
    traces: dict[str, tuple[str, int]] = {}  # trace file name -> (app, seed)
    paths: dict[tuple[str, int], str] = {}
    for seed in seeds:
        for app in apps:
            path = out / f"{app}-s{seed}.jsonl"
            write_trace(path, generate(app, args.workflows, 1.0, seed=seed, profile=profile))
            traces[path.name] = (app, seed)
            paths[(app, seed)] = str(path)
    # A sweep is ~9 runs; the bar's total is an estimate until the sweeps end.
    total = len(paths) * (len(SWEPT) * 9 + 2 * len(MULTS))
    bar = tqdm(total=total, desc="target seeds", unit="run")
    runs: list[dict[str, Any]] = []

    def tag(row: dict[str, Any], load: float | None = None) -> dict[str, Any]:
        app, seed = traces[row["trace"]]
        return {**row, "app": app, "seed": seed, "load": load}

    with Runner(args.workers, args.address) as runner:
        caps, rows = sweep_capacity(
            runner,
            [(p, pol) for p in paths.values() for pol in SWEPT],
            args.engines,
            profile.name,
            params,
            lambda _row: bar.update(1),
        )
        runs += [tag(r) for r in rows]
        specs: dict[tuple[str, float, str], float] = {}
        for trace in paths.values():
            knee = caps[(trace, "least_loaded")]
            for mult in MULTS:
                for pol in ("least_loaded", "wasma"):
                    specs[(Path(trace).name, knee * mult, pol)] = mult
        grid = [
            RunSpec(str(out / name), pol, scale, args.engines, profile.name, params.get(pol, {}))
            for name, scale, pol in specs
        ]
        bar.total = bar.n + len(grid)  # the sweeps are done: the rest is known exactly
        bar.refresh()
        for row in runner.run_all(grid, lambda _row: bar.update(1)):
            # Rows come back as they finish: the spec's own rate scale matches them.
            runs.append(tag(row, specs[(row["trace"], row["rate_scale"], row["policy"])]))
    bar.total = bar.n
    bar.refresh()
    bar.close()
    capacity = {
        (app, seed): {pol: caps[(paths[(app, seed)], pol)] for pol in SWEPT}
        for (app, seed) in paths
    }
    write_report(out, runs, capacity, profile.name, params)
    return 0


def write_report(
    out: Path,
    runs: list[dict[str, Any]],
    capacity: dict[tuple[str, int], dict[str, float]],
    profile: str,
    params: dict[str, dict[str, Any]] | None = None,
) -> None:
    """results.json, summary.md and seeds.png from the runs and the sweeps' capacities."""
    found = targets(runs, capacity)
    bs = load_profile(profile).block_size
    ceilings = {
        (app, seed): prefix_hit_ceiling(load_trace(out / f"{app}-s{seed}.jsonl"), bs)
        for app, seed in capacity
    }
    results = {
        "params": params or {},
        "runs": runs,
        "capacity": {f"{app}-s{seed}.jsonl": c for (app, seed), c in sorted(capacity.items())},
        "prefix_hit_ceiling": {f"{app}-s{seed}.jsonl": v for (app, seed), v in ceilings.items()},
        "targets": [
            {
                "app": t.app,
                "target": t.label,
                "bound": t.bound,
                "upper": t.upper,
                "values": {str(s): None if math.isinf(v) else v for s, v in t.values.items()},
            }
            for t in found
        ],
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    seeds = sorted({seed for _app, seed in capacity})
    md = summary_markdown(found, seeds) + "\n\n" + ceiling_markdown(runs, ceilings, seeds)
    if params:
        said = ", ".join(f"{p}.{k}={v}" for p, kv in sorted(params.items()) for k, v in kv.items())
        md = f"Policy parameters: {said}\n\n{md}"
    (out / "summary.md").write_text(md + "\n")
    plot(found, out)
    print(md)


def report(out: Path) -> int:
    """The summary and plot again from DIR/results.json."""
    path = out / "results.json"
    try:
        data = json.loads(path.read_text())
        runs = data["runs"]
        where = {r["trace"]: (r["app"], r["seed"]) for r in runs}
        capacity = {where[name]: c for name, c in data["capacity"].items()}
        profile = runs[0]["profile"]
        params = data.get("params", {})
    except FileNotFoundError:
        raise SystemExit(f"--report-only: {path} does not exist") from None
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise SystemExit(f"--report-only: {path} is not target_seeds output ({e})") from None
    write_report(out, runs, capacity, profile, params)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
