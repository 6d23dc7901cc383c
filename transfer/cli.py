"""`wasma plan`: print the transfer plan the planner picks (wired into deploy/cli.py)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from wasma.transfer.plan import even_spans
from wasma.transfer.planner import ALGORITHMS, Planner
from wasma.transfer.presets import load_topology
from wasma.transfer.topology import TopologyError
from wasma.transfer.units import parse_size

USAGE_ERROR = 2


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage and exits; we want one readable line and exit 2.
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="wasma plan",
        description="Plan a KV transfer on a cluster topology and print it.",
    )
    parser.add_argument(
        "--topology",
        required=True,
        help="preset:hgx-h100[:NODES], preset:hgx-h200[:NODES], "
        "preset:pcie-8[:NODES], or a YAML file",
    )
    parser.add_argument(
        "--src",
        required=True,
        help="source device, e.g. n0.gpu0; several (comma-separated) when each holds the bytes",
    )
    parser.add_argument(
        "--dst", required=True, help="destination device(s), comma-separated, e.g. n0.gpu1,n1.gpu0"
    )
    parser.add_argument(
        "--bytes",
        required=True,
        dest="num_bytes",
        help="bytes to move (integer, or with a unit: 64MiB, 1GB)",
    )
    parser.add_argument(
        "--algorithms",
        default=None,
        help=f"restrict to these (comma-separated): {','.join(ALGORITHMS)}",
    )
    parser.add_argument(
        "--pattern",
        choices=("broadcast", "gather", "scatter"),
        default="broadcast",
        help="broadcast: every --dst gets all the bytes (every --src holds them); gather: "
        "the --src devices hold consecutive equal parts, one --dst gets them all; scatter: "
        "one --src, each --dst gets its own consecutive equal part",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"algorithm", "predicted_s", "bound_s", "ratio", "steps": [...]} as JSON',
    )
    return parser


def plan_main(argv: Sequence[str]) -> int:
    """Run `wasma plan` with `argv` (the arguments after 'plan'); returns the exit code."""
    try:
        args = build_parser().parse_args(list(argv))
        try:
            num_bytes = parse_size(args.num_bytes)
        except ValueError as exc:
            raise _UsageError(f"--bytes: {exc}") from None
        if num_bytes < 0:
            raise _UsageError("--bytes must be >= 0")
        dsts = [d.strip() for d in args.dst.split(",") if d.strip()]
        if not dsts:
            raise _UsageError("--dst names no device")
        algorithms = args.algorithms.split(",") if args.algorithms else None
        holders = [s.strip() for s in args.src.split(",") if s.strip()]
        if not holders:
            raise _UsageError("--src names no device")
        planner = Planner(load_topology(args.topology))
        if args.pattern == "broadcast":
            plan = planner.plan_from(holders, dsts, num_bytes, algorithms=algorithms)
        elif algorithms is not None:
            raise _UsageError(f"--algorithms applies to broadcasts, not a {args.pattern}")
        elif args.pattern == "gather":
            if len(dsts) != 1:
                raise _UsageError("a gather has one --dst")
            plan = planner.plan_gather(even_spans(holders, num_bytes), dsts[0], num_bytes)
        else:
            if len(holders) != 1:
                raise _UsageError("a scatter has one --src")
            plan = planner.plan_scatter(holders[0], even_spans(dsts, num_bytes), num_bytes)
    except (_UsageError, TopologyError, ValueError) as exc:
        print(f"wasma plan: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    if args.json:
        print(json.dumps(plan.to_dict()))
    else:
        print(plan.describe())
    return 0


if __name__ == "__main__":  # pragma: no cover - convenience entry point
    raise SystemExit(plan_main(sys.argv[1:]))
