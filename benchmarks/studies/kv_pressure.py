"""What KV retention buys when the KV pool is small.

    python -m wasma.benchmarks.studies.kv_pressure  # 64k and 32k KV tokens an engine
    python -m wasma.benchmarks.studies.kv_pressure --kv-tokens 65536 --loads 1,1.5,2

`make bench`'s ablation runs `llama3-8b-h100` as it is, 450k KV tokens an engine: vLLM
admits every request it has KV for and evicts nothing that retention would keep, so
turning retention off changes nothing there. Here the same engines get a smaller KV pool,
as a server started with a lower `--gpu-memory-utilization` (or `--kv-cache-memory`, for
a second model on the GPU) has, and the step model is unchanged. On each pool size:
least_loaded's capacity (the load where it meets 90% of deadlines) is found by a sweep,
then wasma runs at 1x and 1.5x that load with retention, hopeless demotion, slack
priority and KV-aware admission each off in turn. Writes DIR/results.json, DIR/table.md
and the profiles used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

from wasma.benchmarks.apps import generate
from wasma.benchmarks.bench import Runner, RunSpec, sweep_capacity
from wasma.benchmarks.studies.targets import ABLATIONS
from wasma.core.profile import Profile, load_profile
from wasma.scheduler.trace import write_trace

APPS = ("pipeline", "mapreduce", "debate")
# The mechanisms whose effect depends on KV running short: retention keeps blocks that
# pending children will reuse; hopeless demotion and slack priority decide who waits
# (and, in vLLM, who is preempted first) when blocks run out; KV-aware admission keeps
# new workflows at the router while their engine's KV is spoken for.
MECHANISMS = ("retain", "hopeless", "priority", "kv_admission")


def pressure_profile(base: Profile, kv_tokens: int, out: Path) -> Path:
    """Write `base` with a KV pool of `kv_tokens` tokens an engine; returns the file."""
    blocks = kv_tokens // base.block_size
    if blocks < 2:
        raise ValueError(f"--kv-tokens {kv_tokens}: fewer than 2 blocks of {base.block_size}")
    # vLLM refuses a max_model_len the pool cannot hold; shorten it the same way.
    model_len = min(base.max_model_len, blocks * base.block_size)
    variant = dataclasses.replace(
        base,
        name=f"{base.name}-kv{kv_tokens // 1024}k",
        num_kv_blocks=blocks + 1,  # + vLLM's null block
        max_model_len=model_len,
        sources=(
            *base.sources,
            f"KV pool cut to {kv_tokens} tokens an engine by benchmarks/studies/kv_pressure.py",
        ),
    )
    data: dict[str, Any] = dataclasses.asdict(variant)
    data["sources"] = list(variant.sources)
    path = out / f"{variant.name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_profile(str(path))  # the file must load as a profile, or fail here
    return path


def variants() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"all on": {}}
    for m in MECHANISMS:
        out[f"no {m}"] = dict(ABLATIONS[m])
    # Off by default: the slack order sent to the engine as well as used at the router.
    out["engine priority"] = {"engine_priority": True}
    # Retention as a lease alone: kept until it lapses, first kept first evicted (no
    # steps-to-use order, no release once the readers have started).
    out["retention by lease only"] = {"retain_by_use": False}
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = [
        "KV tokens an engine",
        "app",
        "load (x LL capacity)",
        "variant",
        "attainment",
        "goodput wf/s",
        "P95 workflow s",
        "prefix hit",
        "recomputed prompt Mtok",
        "preemptions",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{r['kv_tokens']:,}",
                    r["app"],
                    f"{r['load']:g}x ({r['rate_scale']:.3g})",
                    r["variant"],
                    f"{r['deadline_attainment']:.3f}",
                    f"{r['goodput_wf_per_s']:.3f}",
                    f"{r['p95_workflow_s']:.2f}",
                    f"{r['prefix_hit_ratio']:.3f}",
                    f"{r['recomputed_prompt_tokens'] / 1e6:.2f}",
                    str(r["preemptions"]),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def _floats(text: str, flag: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise SystemExit(f"{flag}: expected positive numbers, got {text!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="out/kv-pressure")
    ap.add_argument("--kv-tokens", default="65536,32768", help="KV pool sizes, tokens an engine")
    ap.add_argument("--loads", default="1,1.5", help="multiples of least_loaded's capacity")
    ap.add_argument("--workflows", type=int, default=400)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args(argv)
    sizes = [int(v) for v in _floats(args.kv_tokens, "--kv-tokens")]
    loads = _floats(args.loads, "--loads")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = load_profile(args.profile)
    traces: dict[str, str] = {}
    for app in APPS:
        path = out / f"{app}.jsonl"
        # Deadlines come from the base profile, so every pool size is held to the same.
        write_trace(path, generate(app, args.workflows, 1.0, seed=7, profile=base))
        traces[app] = str(path)
    var = variants()
    # The sweep's length is not known ahead; ~9 runs a search is typical.
    total = len(sizes) * len(APPS) * (9 + len(loads) * len(var))
    bar = tqdm(total=total, desc="kv pressure", unit="run")
    rows: list[dict[str, Any]] = []
    capacity: dict[str, dict[str, float]] = {}
    with Runner(args.workers) as runner:
        for kv in sizes:
            prof = str(pressure_profile(base, kv, out))
            caps, _ = sweep_capacity(
                runner,
                [(t, "least_loaded") for t in traces.values()],
                args.engines,
                prof,
                {},
                lambda _row: bar.update(1),
            )
            capacity[str(kv)] = {app: caps[(t, "least_loaded")] for app, t in traces.items()}
            jobs: dict[tuple[str, float, str], tuple[str, float, str]] = {}
            specs: list[RunSpec] = []
            for app, t in traces.items():
                for x in loads:
                    for name, params in var.items():
                        scale = caps[(t, "least_loaded")] * x
                        specs.append(RunSpec(t, "wasma", scale, args.engines, prof, params))
                        jobs[(Path(t).name, scale, _params_key(params))] = (app, x, name)
            for row in runner.run_all(specs, lambda _row: bar.update(1)):
                app, x, name = jobs[_key(row)]
                rows.append({**row, "kv_tokens": kv, "app": app, "load": x, "variant": name})
    order = list(var)
    rows.sort(
        key=lambda r: (-r["kv_tokens"], APPS.index(r["app"]), r["load"], order.index(r["variant"]))
    )
    bar.total = bar.n  # the sweeps' length was an estimate: end the bar at what ran
    bar.refresh()
    bar.close()
    (out / "results.json").write_text(
        json.dumps({"runs": rows, "least_loaded_capacity": capacity}, indent=2)
    )
    md = table(rows)
    (out / "table.md").write_text(md + "\n")
    print(md)
    return 0


def _params_key(params: Any) -> str:
    return json.dumps(dict(params or {}), sort_keys=True)


def _key(row: dict[str, Any]) -> tuple[str, float, str]:
    # Rows are matched to their cells by what they ran, not by position. (The rate scale
    # is the spec's own float, returned unchanged.)
    return (row["trace"], row["rate_scale"], _params_key(row.get("params")))


if __name__ == "__main__":
    raise SystemExit(main())
