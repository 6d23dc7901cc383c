"""`make bench`: the wasma policy's targets, measured side by side in one run.

For each app (pipeline, mapreduce, debate) on 8 simulated engines of a profile:
1. capacity sweeps (highest rate scale with attainment >= 0.9) for every policy;
2. every policy at 1x, 1.5x and 2x the rate where least_loaded attains 90%;
3. an ablation: wasma with each mechanism off in turn, and with no DAG registered (the
   router sees requests only and learns the app's shape), at 1.5x that rate;
4. wasma with each option that is off by default turned on, at 1x, 1.5x and 2x;
5. decision latency at 64 engines with 100k indexed blocks and at 1,024 engines.
Writes DIR/targets.json, DIR/targets.md (the tables in the README) and plots.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from wasma.benchmarks.apps import generate
from wasma.benchmarks.bench import Runner, RunSpec, sweep_capacity
from wasma.benchmarks.metrics import percentile
from wasma.benchmarks.report import plot_results
from wasma.core.events import BlockStored
from wasma.core.profile import load_profile
from wasma.scheduler.policy import PolicyContext, RequestInfo
from wasma.scheduler.prefix_index import PrefixIndex
from wasma.scheduler.pricing import LinkBandwidthPricer
from wasma.scheduler.registry import default_registry
from wasma.scheduler.state import Charge, ClusterState
from wasma.scheduler.trace import write_trace
from wasma.scheduler.workflows import WorkflowRegistry

APPS = ("pipeline", "mapreduce", "debate")
POLICIES = ("round_robin", "least_loaded", "session", "prefix_aware", "kv_aware", "wasma")
SWEPT = ("least_loaded", "prefix_aware", "kv_aware", "wasma")
MULTS = (1.0, 1.5, 2.0)  # rates as multiples of least_loaded's capacity (its "knee")
# Each variant turns one mechanism off.
ABLATIONS: dict[str, dict[str, Any]] = {
    "colocate": {"colocate": False},
    "transfer": {"transfer": False},
    "broadcast": {"broadcast": False},
    "priority": {"priority": False},
    "retain": {"retain": False},
    "hopeless": {"hopeless": False},
    "admission": {"admission": False, "hopeless_slowdown": 1e9},
    "load_aware": {"load_aware": False},
    "kv_admission": {"kv_admission": False},
}
_NO_DAG = "no registered DAG (learned shapes)"
# Each variant turns on one option that is off by default (a trade the reader may want).
OPTIONS: dict[str, dict[str, Any]] = {
    "admission_bias": {"admission_bias": True},
}


def decision_latency(engines: int, blocks: int, requests: int = 2000) -> dict[str, float]:
    """p50/p99 µs of one wasma decision with `blocks` indexed blocks over `engines`."""
    profile = load_profile("llama3-8b-h100")
    names = [f"e{i}" for i in range(engines)]
    state = ClusterState(names, profile.num_kv_blocks - 1)
    ctx = PolicyContext(
        state=state,
        index=PrefixIndex(names, max_blocks=max(blocks * 2, 1)),
        workflows=WorkflowRegistry(),
        profile=profile,
        pricer=LinkBandwidthPricer(names),
    )
    policy = default_registry().create("wasma", ctx)
    rng = random.Random(0)
    # Prefixes of 256 blocks (4k tokens), each on a couple of engines.
    chains: list[list[int]] = []
    stored = 0
    while stored < blocks:
        base = rng.getrandbits(62)
        chain = [hash((base, i)) for i in range(256)]
        chains.append(chain)
        for e in rng.sample(names, min(2, engines)):
            ctx.index.apply(BlockStored(e, tuple(chain), None))
        stored += 256
    for i in range(len(state.loads)):
        state.on_dispatch(f"bg{i}", i, Charge(rng.randint(0, 4000), rng.randint(0, 9000), 100))
    # The index is long-lived state: keep the collector from rescanning it (a server
    # does the same after start-up with gc.freeze()).
    gc.collect()
    gc.freeze()
    lat: list[float] = []
    cpu: list[float] = []
    for r in range(requests):
        chain = rng.choice(chains)
        hashes = chain[: rng.randint(64, 256)] + [rng.getrandbits(62) for _ in range(16)]
        req = RequestInfo(f"r{r}", f"w{r}", "n", "app", len(hashes) * 16, 200, hashes, 0.0)
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        policy.place(req, 0.0)
        lat.append((time.perf_counter_ns() - t0) / 1000)
        cpu.append((time.thread_time_ns() - c0) / 1000)
    gc.unfreeze()
    # Wall time includes the OS preempting this process on a shared machine; CPU time
    # is the decision's own cost.
    return {
        "p50_us": percentile(lat, 50),
        "p99_us": percentile(lat, 99),
        "cpu_p50_us": percentile(cpu, 50),
        "cpu_p99_us": percentile(cpu, 99),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="out/bench")
    ap.add_argument("--workflows", type=int, default=400)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--address", default=None, help="Ray address to run the grid on")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = load_profile(args.profile)
    traces = {}
    for app in APPS:
        path = out / f"{app}.jsonl"
        write_trace(path, generate(app, args.workflows, 1.0, seed=7, profile=profile))
        traces[app] = str(path)
    total = len(APPS) * (
        len(SWEPT) * 9 + len(MULTS) * (len(POLICIES) + 1 + len(OPTIONS)) + len(ABLATIONS)
    )
    bar = tqdm(total=total, desc="make bench", unit="run")
    runs: list[dict[str, Any]] = []
    with Runner(args.workers, args.address) as runner:
        caps, rows = sweep_capacity(
            runner,
            [(traces[a], p) for a in APPS for p in SWEPT],
            args.engines,
            profile.name,
            {},
            lambda _row: bar.update(1),
        )
        runs += rows
        specs: list[RunSpec] = []
        for app in APPS:
            knee = caps[(traces[app], "least_loaded")]
            for mult in MULTS:
                for pol in POLICIES:
                    specs.append(RunSpec(traces[app], pol, knee * mult, args.engines, profile.name))
                # No DAG registered: requests only, the app's shape learned as it runs.
                specs.append(
                    RunSpec(
                        traces[app], "wasma", knee * mult, args.engines, profile.name, dags=False
                    )
                )
                for on in OPTIONS.values():
                    specs.append(
                        RunSpec(traces[app], "wasma", knee * mult, args.engines, profile.name, on)
                    )
            for off in ABLATIONS.values():
                specs.append(
                    RunSpec(traces[app], "wasma", knee * 1.5, args.engines, profile.name, off)
                )
        runs += runner.run_all(specs, lambda _row: bar.update(1))
    bar.close()
    capacity: dict[str, dict[str, float]] = {Path(t).name: {} for t in traces.values()}
    for (t, p), v in caps.items():
        capacity[Path(t).name][p] = v
    decisions = {
        "64_engines_100k_blocks": decision_latency(64, 100_000),
        "1024_engines_100k_blocks": decision_latency(1024, 100_000, requests=500),
    }
    results = {"runs": runs, "capacity": capacity, "decision_latency": decisions}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot_results({"runs": [r for r in runs if _plain(r)]}, out)
    md = targets_markdown(results, traces)
    (out / "targets.md").write_text(md)
    print(md)
    return 0


def _plain(row: dict[str, Any]) -> bool:
    """A target cell's run: not a sweep step, no mechanism off, DAGs registered."""
    return not row.get("sweep") and not row.get("params") and row.get("dags", True)


def targets_markdown(results: dict[str, Any], traces: dict[str, str]) -> str:
    runs = results["runs"]
    cap = results["capacity"]
    lines = ["### Targets (8 engines, llama3-8b-h100)", ""]
    lines.append(
        "| app | rate (x LL knee) | P95 wasma / least_loaded | goodput wasma / least_loaded "
        "| attainment LL | attainment wasma |"
    )
    lines.append("|---|---|---|---|---|---|")
    for app, mult, knee, at in _cells(runs, cap, traces):
        row = {r["policy"]: r for r in at if _plain(r)}
        ll, wa = row["least_loaded"], row["wasma"]
        lines.append(
            f"| {app} | {mult:g}x ({knee * mult:.3g}) "
            f"| {wa['p95_workflow_s'] / ll['p95_workflow_s']:.2f} "
            f"| {wa['goodput_wf_per_s'] / max(ll['goodput_wf_per_s'], 1e-9):.2f} "
            f"| {ll['deadline_attainment']:.3f} | {wa['deadline_attainment']:.3f} |"
        )
    lines += ["", "| app | " + " | ".join(SWEPT) + " | wasma / best KV-aware peer |"]
    lines.append("|---|" + "---|" * (len(SWEPT) + 1))
    for app, path in traces.items():
        c = cap[Path(path).name]
        best_peer = max(c["prefix_aware"], c["kv_aware"])
        lines.append(
            f"| {app} | "
            + " | ".join(f"{c[p]:.3g}" for p in SWEPT)
            + f" | {c['wasma'] / best_peer:.2f} |"
        )
    lines += [
        "",
        "### Without registered DAGs (wasma learns each app's shape from a cold start)",
        "",
        "| app | rate (x LL knee) | attainment: DAG / requests only "
        "| P95 wasma / least_loaded: DAG / requests only "
        "| goodput wasma / least_loaded: DAG / requests only |",
        "|---|---|---|---|---|",
    ]
    for app, mult, _knee, cell in _cells(runs, cap, traces):
        at = [r for r in cell if not r.get("params")]
        ll = next(r for r in at if r["policy"] == "least_loaded")
        dag = next(r for r in at if r["policy"] == "wasma" and r.get("dags", True))
        blind = next((r for r in at if r["policy"] == "wasma" and not r.get("dags", True)), None)
        if blind is None:
            continue  # results from before this table
        lines.append(f"| {app} | {mult:g}x | {_beside(dag, blind, ll)}")
    lines += ["", "### Ablation (wasma at 1.5x the least_loaded knee; each mechanism off)", ""]
    lines.append("| app | variant | attainment | goodput wf/s | P95 workflow s | prefix hit |")
    lines.append("|---|---|---|---|---|---|")
    # In the variants' own order, whatever the order of the runs.
    order = ["all on", _NO_DAG, *(f"no {m}" for m in ABLATIONS)]
    for app, mult, _knee, cell in _cells(runs, cap, traces):
        if mult != 1.5:
            continue
        rows: dict[str, str] = {}
        for r in cell:
            params = r.get("params")
            if r["policy"] != "wasma" or (params and params not in ABLATIONS.values()):
                continue  # another policy, or an option's run (its own table)
            label = "all on" if r.get("dags", True) else _NO_DAG
            for mechanism, off in ABLATIONS.items():
                if params == off:
                    label = f"no {mechanism}"
            rows[label] = (
                f"| {app} | {label} | {r['deadline_attainment']:.3f} "
                f"| {r['goodput_wf_per_s']:.3f} | {r['p95_workflow_s']:.2f} "
                f"| {r['prefix_hit_ratio']:.3f} |"
            )
        lines += [rows[label] for label in order if label in rows]
    lines += _options_markdown(runs, cap, traces)
    d = results["decision_latency"]
    lines += [
        "",
        "### Decision latency (wasma)",
        "",
        "| setting | p50 µs | p99 µs | CPU p50 µs | CPU p99 µs |",
        "|---|---|---|---|---|",
    ]
    for k, v in d.items():
        lines.append(
            f"| {k.replace('_', ' ')} | {v['p50_us']:.0f} | {v['p99_us']:.0f} "
            f"| {v['cpu_p50_us']:.0f} | {v['cpu_p99_us']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _cells(
    runs: list[dict[str, Any]], cap: dict[str, dict[str, float]], traces: dict[str, str]
) -> Iterator[tuple[str, float, float, list[dict[str, Any]]]]:
    """(app, multiple of least_loaded's knee, the knee, the runs at that rate on the app's
    trace that are no sweep step) for every app and multiple, in table order."""
    for app, path in traces.items():
        name = Path(path).name
        knee = cap[name]["least_loaded"]
        for mult in MULTS:
            yield (
                app,
                mult,
                knee,
                [
                    r
                    for r in runs
                    if r["trace"] == name
                    and not r.get("sweep")
                    and abs(r["rate_scale"] - knee * mult) < 1e-9
                ],
            )


def _beside(a: dict[str, Any], b: dict[str, Any], ll: dict[str, Any]) -> str:
    """Attainment, then P95 and goodput as ratios to least_loaded's, each `a / b`."""
    p95, good = ll["p95_workflow_s"], max(ll["goodput_wf_per_s"], 1e-9)
    return (
        f"{a['deadline_attainment']:.3f} / {b['deadline_attainment']:.3f} "
        f"| {a['p95_workflow_s'] / p95:.2f} / {b['p95_workflow_s'] / p95:.2f} "
        f"| {a['goodput_wf_per_s'] / good:.2f} / {b['goodput_wf_per_s'] / good:.2f} |"
    )


def _options_markdown(
    runs: list[dict[str, Any]], cap: dict[str, dict[str, float]], traces: dict[str, str]
) -> list[str]:
    """Each option beside the default wasma run at the same rate (ratios to least_loaded)."""
    lines = [
        "",
        "### Options off by default (wasma with the option on, beside the default)",
        "",
        "| app | rate (x LL knee) | option | attainment: default / on "
        "| P95 wasma / least_loaded: default / on | goodput wasma / least_loaded: default / on |",
        "|---|---|---|---|---|---|",
    ]
    for app, mult, _knee, cell in _cells(runs, cap, traces):
        at = [r for r in cell if r.get("dags", True)]
        ll = next((r for r in at if r["policy"] == "least_loaded"), None)
        base = next((r for r in at if r["policy"] == "wasma" and not r.get("params")), None)
        if ll is None or base is None:
            continue
        for option, on in OPTIONS.items():
            r = next((r for r in at if r["policy"] == "wasma" and r.get("params") == on), None)
            if r is None:
                continue  # results from before this option
            lines.append(f"| {app} | {mult:g}x | {option} | {_beside(base, r, ll)}")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
