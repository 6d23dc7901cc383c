"""The planner against its bound and against NCCL-style ring and tree, on the presets.

    python -m wasma.benchmarks.studies.plan_table [--sizes 1GiB,64MiB,4KiB] [--json FILE]

For each preset at 1, 2 and 4 nodes and each destination set (1 GPU; the source node's 7
others; the next node's 8; the first 16 GPUs' 15 others; all 31 others), the plan's
predicted time over the max-flow bound, over the best of a pipelined ring (chain) and a
tree (binomial; direct for one destination) priced by the same model, and the planning
time per plan: cold (a fresh planner: max flows, tree packing, pricing) and cached (the
same pattern again, as the router sees it). Source is n0.gpu0 throughout.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wasma.transfer import Planner, Topology, TopologyBuilder, TransferPlan, build_preset
from wasma.transfer import algorithms as alg
from wasma.transfer.plan import Span, even_spans
from wasma.transfer.units import format_bytes, parse_size

PRESETS = ("hgx-h100", "hgx-h200", "pcie-8")
NODES = (1, 2, 4)
SRC = "n0.gpu0"


def destination_sets(nodes: int) -> list[tuple[str, list[str]]]:
    gpus = [f"n{h}.gpu{g}" for h in range(nodes) for g in range(8)]
    sets = [
        ("1 (n0.gpu1)" if nodes == 1 else "1 (n1.gpu0)", ["n0.gpu1" if nodes == 1 else "n1.gpu0"])
    ]
    sets.append(("7 (n0 rest)", gpus[1:8]))
    if nodes >= 2:
        sets.append(("8 (n1 all)", gpus[8:16]))
        sets.append(("15 (n0+n1)", gpus[1:16]))
    if nodes >= 4:
        sets.append(("31 (all)", gpus[1:]))
    return sets


def random_cluster(rng: random.Random) -> Topology:
    """1-4 hosts of 1-4 GPUs: maybe an NVSwitch (some GPUs not on it; on even hosts it
    multicasts), one or two PCIe
    switches under a CPU, 0-2 NICs of mixed speeds a host, a fabric switch between."""
    builder = TopologyBuilder("random")
    hosts = rng.randint(1, 4)
    if hosts > 1:
        builder.add_device("fabric", "switch")
    for h in range(hosts):
        host = f"n{h}"
        cpu = builder.add_device(f"{host}.cpu0", "cpu", host)
        switches = []
        for p in range(rng.randint(1, 2)):
            switches.append(builder.add_device(f"{host}.pcie{p}", "pcie_switch", host))
            builder.add_link(switches[-1], cpu, rng.uniform(10e9, 60e9), 0.5e-6, "pcie")
        nvswitch = None
        if rng.random() < 0.6:
            # Even hosts' switches multicast (an H100-class NVSwitch), odd ones do not
            # (older ones): no draw of its own, so the clusters stay as they were.
            nvswitch = builder.add_device(
                f"{host}.nvswitch", "nvswitch", host, multicast=h % 2 == 0
            )
        for g in range(rng.randint(1, 4)):
            gpu = builder.add_device(f"{host}.gpu{g}", "gpu", host)
            builder.add_link(gpu, rng.choice(switches), rng.uniform(10e9, 60e9), 0.5e-6, "pcie")
            if nvswitch is not None and rng.random() < 0.8:  # some GPUs miss NVLink
                builder.add_link(gpu, nvswitch, rng.uniform(100e9, 450e9), 0.7e-6, "nvlink")
        if hosts > 1:
            for n in range(rng.randint(1, 2)):
                nic = builder.add_device(f"{host}.nic{n}", "nic", host)
                builder.add_link(nic, rng.choice(switches), rng.uniform(20e9, 60e9), 0.5e-6, "pcie")
                builder.add_link(nic, "fabric", rng.choice([12.5e9, 25e9, 50e9]), 1.5e-6, "network")
    return builder.build()


def random_sweep(seeds: int, parts: bool = False) -> dict[str, Any]:
    """The planner's pick over the bound on random clusters (`random_cluster`), one
    source to a random number of the other GPUs, at 64 MiB and 1 GiB; with `parts`, a
    scatter to them and a gather from them of uneven parts (cut at random)."""
    ratios: list[float] = []
    worst: list[tuple[float, int, int]] = []
    for seed in range(seeds):
        rng = random.Random(seed)
        topology = random_cluster(rng)
        gpus = topology.gpus()
        rng.shuffle(gpus)
        if len(gpus) < 2:
            continue
        dsts = gpus[1 : 1 + rng.randint(1, len(gpus) - 1)]
        for size in (64 << 20, 1 << 30):
            plans = [Planner(topology).plan(gpus[0], dsts, size)]
            if parts:
                cuts = sorted(rng.sample(range(1, size), len(dsts) - 1))
                edges = [0, *cuts, size]
                spans = [Span(d, a, b - a) for d, a, b in zip(dsts, edges, edges[1:], strict=False)]
                plans = [
                    Planner(topology).plan_scatter(gpus[0], spans, size),
                    Planner(topology).plan_gather(spans, gpus[0], size),
                ]
            for plan in plans:
                ratio = plan.ratio
                assert ratio is not None
                ratios.append(ratio)
                worst.append((ratio, seed, size))
    ratios.sort()
    return {
        "cases": len(ratios),
        "median": ratios[len(ratios) // 2],
        "p90": ratios[int(0.9 * len(ratios))],
        "max": ratios[-1],
        # A plan under its bound would mean the bound is not one (float noise aside).
        "under_bound": sum(1 for r in ratios if r < 1 - 1e-9),
        "above_1.15": [(s, b) for r, s, b in sorted(worst, reverse=True) if r > 1.15],
    }


def baseline_s(planner: Planner, dsts: list[str], size: int) -> tuple[str, float]:
    """Best of NCCL's shapes priced by the same model: ring (chain) and tree."""
    names = ["direct"] if len(dsts) == 1 else ["chain", "binomial_tree"]
    if len(dsts) == 2:
        names = ["chain"]
    plan = planner.plan(SRC, dsts, size, algorithms=names)
    return plan.algorithm, plan.predicted_s


def timed(
    topology: Topology, make: Callable[[Planner], TransferPlan]
) -> tuple[Planner, TransferPlan, float, float]:
    """The planner, its plan, and the seconds to plan cold (a fresh planner: max flows,
    packing, pricing) and cached (the same call again, mean of 2000)."""
    start = time.perf_counter()
    planner = Planner(topology)
    plan = make(planner)
    cold_s = time.perf_counter() - start
    repeats = 2000
    start = time.perf_counter()
    for _ in range(repeats):
        make(planner)
    return planner, plan, cold_s, (time.perf_counter() - start) / repeats


def row(preset: str, nodes: int, label: str, dsts: list[str], size: int) -> dict[str, Any]:
    topology = build_preset(preset, nodes)
    _, plan, cold_s, cached_s = timed(topology, lambda p: p.plan(SRC, dsts, size))
    shape, shape_s = baseline_s(Planner(topology), dsts, size)
    assert plan.bound_s is not None and plan.ratio is not None
    return {
        "preset": preset,
        "nodes": nodes,
        "dsts": label,
        "bytes": size,
        "algorithm": plan.algorithm,
        "hops": len(plan.hops),
        "predicted_s": plan.predicted_s,
        "bound_s": plan.bound_s,
        "ratio": plan.ratio,
        "baseline": shape,
        "baseline_s": shape_s,
        "vs_baseline": plan.predicted_s / shape_s,
        "cold_ms": cold_s * 1e3,
        "cached_us": cached_s * 1e6,
    }


def parts_row(
    preset: str, nodes: int, label: str, peers: list[str], size: int
) -> list[dict[str, Any]]:
    """A scatter from SRC to `peers` and a gather from them to SRC, equal parts: the
    plan, its bound, each part sent straight (what per-peer send/recv does), planning time."""
    topology = build_preset(preset, nodes)
    spans = even_spans(peers, size)
    rows = []
    for pattern in ("scatter", "gather"):

        def make(planner: Planner, pattern: str = pattern) -> TransferPlan:
            if pattern == "scatter":
                return planner.plan_scatter(SRC, spans, size)
            return planner.plan_gather(spans, SRC, size)

        planner, plan, cold_s, cached_s = timed(topology, make)
        straight = alg.straight(
            planner.links,
            [
                (SRC, s.device, s.offset_bytes, s.num_bytes)
                if pattern == "scatter"
                else (s.device, SRC, s.offset_bytes, s.num_bytes)
                for s in spans
            ],
        )
        straight_s = planner.predict_s(straight)
        assert plan.bound_s is not None and plan.ratio is not None
        rows.append(
            {
                "preset": preset,
                "nodes": nodes,
                "peers": label,
                "pattern": pattern,
                "bytes": size,
                "algorithm": plan.algorithm,
                "hops": len(plan.hops),
                "predicted_s": plan.predicted_s,
                "bound_s": plan.bound_s,
                "ratio": plan.ratio,
                "straight_s": straight_s,
                "vs_straight": plan.predicted_s / straight_s,
                "cold_ms": cold_s * 1e3,
                "cached_us": cached_s * 1e6,
            }
        )
    return rows


def parts_main(presets: list[str], sizes: list[int]) -> list[dict[str, Any]]:
    print(
        "| preset | nodes | peers | pattern | size | plan | hops | predicted | bound | "
        "predicted / bound | each part straight | predicted / that | plan cold | plan cached |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for preset in presets:
        for nodes in NODES:
            for label, peers in destination_sets(nodes)[1:]:
                for size in sizes:
                    for r in parts_row(preset, nodes, label, peers, size):
                        rows.append(r)
                        print(
                            f"| {preset} | {nodes} | {label} | {r['pattern']} "
                            f"| {format_bytes(size)} | {r['algorithm']} | {r['hops']} "
                            f"| {_t(r['predicted_s'])} | {_t(r['bound_s'])} | {r['ratio']:.3f} "
                            f"| {_t(r['straight_s'])} | {r['vs_straight']:.3f} "
                            f"| {r['cold_ms']:.1f} ms | {r['cached_us']:.1f} us |",
                            flush=True,
                        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1GiB,64MiB,4KiB")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument(
        "--random", type=int, default=0, help="instead: sweep this many random clusters"
    )
    parser.add_argument(
        "--parts", action="store_true", help="gathers and scatters instead of broadcasts"
    )
    args = parser.parse_args(argv)
    if args.random:
        print(json.dumps(random_sweep(args.random, args.parts)))
        return 0
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows: list[dict[str, Any]] = []
    if args.parts:
        rows = parts_main(args.presets.split(","), sizes)
        _summary(rows)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return 0
    print(
        "| preset | nodes | destinations | size | plan | hops | predicted | bound | "
        "predicted / bound | NCCL-style best | predicted / that | plan cold | plan cached |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for preset in args.presets.split(","):
        for nodes in NODES:
            for label, dsts in destination_sets(nodes):
                for size in sizes:
                    r = row(preset, nodes, label, dsts, size)
                    rows.append(r)
                    print(
                        f"| {preset} | {nodes} | {label} | {format_bytes(size)} | {r['algorithm']} "
                        f"| {r['hops']} | {_t(r['predicted_s'])} | {_t(r['bound_s'])} "
                        f"| {r['ratio']:.3f} | {r['baseline']} {_t(r['baseline_s'])} "
                        f"| {r['vs_baseline']:.3f} | {r['cold_ms']:.1f} ms "
                        f"| {r['cached_us']:.1f} us |",
                        flush=True,
                    )
    _summary(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _summary(rows: list[dict[str, Any]]) -> None:
    big = [r for r in rows if r["bytes"] >= 64 << 20]
    worst = max(big, key=lambda r: r["ratio"], default=None)
    if worst is not None:
        over = [r for r in big if r["ratio"] > 1.15]
        where = worst.get("dsts") or f"{worst['pattern']} {worst['peers']}"
        print(
            f"\n>= 64 MiB: worst predicted / bound {worst['ratio']:.3f} "
            f"({worst['preset']} x{worst['nodes']}, {where}, "
            f"{format_bytes(worst['bytes'])}); {len(over)} of {len(big)} cases above 1.15"
        )
    print(f"cached planning: max {max(r['cached_us'] for r in rows):.1f} us per plan")


def _t(seconds: float) -> str:
    return f"{seconds * 1e3:.4f} ms" if seconds < 0.1 else f"{seconds:.3f} s"


if __name__ == "__main__":
    raise SystemExit(main())
