"""The `wasma` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line: `wasma bench: error: ...`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class CLIError(Exception):
    """A user mistake; printed as one line, exit status 2."""


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    # Far outside these, arrival times or deadlines overflow a float's useful range.
    if not 1e-9 <= v <= 1e9:
        raise argparse.ArgumentTypeError(f"expected a positive number (1e-9 to 1e9), got {text!r}")
    return v


def _int_in(low: int, high: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer in low..high, else an error saying `what` it wants."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = low - 1
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    return parse


_seed = _int_in(0, 2**64 - 1, "an integer in 0..2^64-1")
_port = _int_in(0, 65535, "a port in 0..65535")


def _out_dir(text: str) -> str:
    """A folder for results, checked before a run that may take minutes writes to it."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a folder")
    return text


def _http_url(text: str) -> str:
    if not text.startswith(("http://", "https://")) or len(text) <= len("https://"):
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {text!r}")
    return text


def _float_list(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers like 0.5,1,2, got {text!r}"
        ) from None
    if not vals or any(not 1e-9 <= v <= 1e9 for v in vals):
        raise argparse.ArgumentTypeError(
            f"rates must be positive numbers (1e-9 to 1e9), got {text!r}"
        )
    return vals


def _name_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list of names")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="wasma", description="Workflow-aware scheduling for multi-agent LLM serving."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    trace = sub.add_parser("trace", help="workload traces")
    tsub = trace.add_subparsers(dest="trace_command", required=True)
    gen = tsub.add_parser("gen", help="generate a trace of one multi-agent application")
    gen.add_argument("--app", required=True, choices=["pipeline", "mapreduce", "debate"])
    gen.add_argument("--workflows", type=_positive_int, required=True)
    gen.add_argument("--rate", type=_positive_float, required=True, help="workflows per second")
    gen.add_argument("--seed", type=_seed, default=0)
    gen.add_argument("--profile", default="llama3-8b-h100", help="for deadlines")
    gen.add_argument("--slack", type=_positive_float, default=None, help="deadline factor")
    gen.add_argument(
        "--token-scale",
        type=_positive_float,
        default=1.0,
        help="scale every token count (e.g. 0.25 for the tiny model's 4k context)",
    )
    gen.add_argument("-o", "--output", required=True)
    imp = tsub.add_parser("import", help="convert a Mooncake or Azure trace to wasma's format")
    imp.add_argument("--format", required=True, choices=["mooncake", "azure"])
    imp.add_argument("file")
    imp.add_argument("--profile", default="llama3-8b-h100", help="for deadlines and max_model_len")
    imp.add_argument("--slack", type=_positive_float, default=2.0, help="deadline factor")
    imp.add_argument(
        "--sessions",
        action="store_true",
        help="Mooncake: a request continuing an earlier one's whole context is its child "
        "(a conversation's next turn); a conversation becomes one workflow",
    )
    imp.add_argument("-o", "--output", required=True)
    exp = tsub.add_parser("export", help="write a wasma trace as a Mooncake trace")
    exp.add_argument("--format", required=True, choices=["mooncake"])
    exp.add_argument("file")
    exp.add_argument("-o", "--output", required=True)

    b = sub.add_parser("bench", help="simulate traces under policies and loads")
    b.add_argument("--trace", action="append", required=True, help="repeatable")
    b.add_argument("--policies", type=_name_list, default=["least_loaded", "wasma"])
    b.add_argument("--engines", type=_positive_int, default=8)
    b.add_argument("--profile", default="llama3-8b-h100")
    b.add_argument("--rates", type=_float_list, default=None, help="rate scales, e.g. 1,1.5,2")
    b.add_argument("--sweep", action="store_true", help="find each policy's capacity")
    b.add_argument(
        "--full-probes",
        action="store_true",
        help="run every probe of --sweep to the end (by default a probe stops once so many "
        "workflows missed their deadlines that it fails whatever follows; same capacities)",
    )
    b.add_argument("--out", required=True, type=_out_dir)
    b.add_argument("--workers", type=_positive_int, default=None)
    b.add_argument(
        "--cpu-tier-gib",
        type=_positive_float,
        default=None,
        help="give every engine a CPU KV tier of this many GiB (vLLM's --kv-offloading-size)",
    )
    b.add_argument("--address", default=None, help="Ray address: run the grid as Ray tasks")
    b.add_argument(
        "--topology",
        default="preset:hgx-h100",
        help="the engines' network, preset:NAME (hgx-h100, hgx-h200, pcie-8); engines fill "
        "its GPUs 8 to a node, and KV moves are priced and timed on it",
    )
    b.add_argument(
        "--no-dags",
        action="store_true",
        help="the router sees requests only (workflow id, node, parents, deadline), as from "
        "agents that never register their DAG; wasma plans from the app shapes it learns",
    )
    b.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="POLICY.KEY=VALUE",
        help="policy parameter, e.g. wasma.transfer=false",
    )

    rp = sub.add_parser("replay", help="drive a live gateway with a trace")
    rp.add_argument("--trace", required=True)
    rp.add_argument("--url", required=True, type=_http_url)
    rp.add_argument("--out", required=True, type=_out_dir)
    rp.add_argument("--rate-scale", type=_positive_float, default=1.0)
    rp.add_argument("--api-key", default=None)
    rp.add_argument("--model", default=None)
    rp.add_argument("--label", default="live", help="policy label written into results")
    rp.add_argument("--vocab-size", type=_positive_int, default=None)
    rp.add_argument("--concurrency", type=_positive_int, default=256, help="max requests in flight")
    rp.add_argument("--timeout", type=_positive_float, default=600.0, help="per request, seconds")
    rp.add_argument("--no-progress", action="store_true")
    rp.add_argument(
        "--register-workflows",
        action="store_true",
        help="POST each workflow's DAG to /v1/workflows when it arrives (wasma gateways)",
    )

    sv = sub.add_parser("serve", help="run the OpenAI-compatible gateway and router")
    sv.add_argument("--engines", required=True, help="sim:N | vllm:N | openai:URL[,URL...]")
    sv.add_argument("--model", default=None, help="model directory (vllm engines)")
    sv.add_argument("--policy", default="wasma")
    sv.add_argument("--profile", default=None, help="simulator profile (sim engines)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=_port, default=8000)
    sv.add_argument("--config", default=None)
    sv.add_argument("--address", default=None, help="Ray address of an existing cluster")
    sv.add_argument("--api-key-file", default=None)
    sv.add_argument(
        "--router-in-process",
        action="store_true",
        help="run the router in the gateway process instead of a Ray actor",
    )
    sv.add_argument(
        "--shared-router",
        default=None,
        metavar="NAME",
        help="route through the detached Ray actor NAME, shared by every gateway that "
        "names it (the first creates it): several gateway processes or pods, one "
        "scheduling state",
    )
    sv.add_argument(
        "--relay-tokens",
        action="store_true",
        help="with the router in a Ray actor: stream every token through it, as before "
        "direct streams (by default the gateway streams from vLLM engines itself and "
        "tells the router only of progress)",
    )
    sv.add_argument(
        "--sim-speed", type=_positive_float, default=None, help="sim engines: run N x faster"
    )
    sv.add_argument(
        "--kv-events",
        default=None,
        help="openai engines: their ZMQ KV-event endpoints, tcp://HOST:PORT[,...] in order "
        "(each vLLM server must publish on tcp://*:PORT; a non-wildcard address makes vLLM "
        "connect out and nothing arrives)",
    )
    sv.add_argument(
        "--remote-tokens",
        choices=("auto", "on", "off"),
        default="off",
        help="openai engines: drive each vLLM server through its token-in/token-out "
        "generation (/inference/v1/generate, on `vllm serve --enable-scale-out`) where the "
        "answer fits in token ids, derendered here with vLLM's derenderer (a stream cut by "
        "a failure continues on another engine; answers equal the server's when this "
        "gateway's front-end settings are the server's); auto: where the server offers "
        "it; off (default): pass every request's body through, answered exactly as the "
        "server answers",
    )
    sv.add_argument(
        "--kv-transfer",
        action="store_true",
        help="vllm engines: run the wasma KV connector so the policy can move a prefix's KV "
        "between engines instead of recomputing it",
    )
    sv.add_argument(
        "--kv-offloading-size",
        type=_positive_float,
        default=None,
        metavar="GIB",
        help="vllm engines: a CPU KV tier of this many GiB each (vLLM's own offloading; "
        "the router reads the tier from KV events of medium CPU). Needs a GPU build of vLLM",
    )
    sv.add_argument("--served-model-name", default=None)
    sv.add_argument(
        "--ray-serve",
        action="store_true",
        help="serve through Ray Serve LLM: --engines vllm:N LLMServer replicas behind Ray's "
        "ingress, placed by wasma's WorkflowRouter (wasma.ray_serve)",
    )
    # vLLM's front-end flags, named and meaning what they mean to `vllm serve`: the
    # gateway renders and derenders with them (give the engines the same ones).
    sv.add_argument(
        "--tool-call-parser",
        default=None,
        help="as vllm serve: the tool call parser for the model (e.g. hermes)",
    )
    sv.add_argument("--reasoning-parser", default=None, help="as vllm serve: the reasoning parser")
    sv.add_argument(
        "--chat-template",
        default=None,
        help="as vllm serve: a chat template file (or template text) replacing the model's",
    )
    sv.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="as vllm serve: let the model decide to call tools (tool_choice auto)",
    )
    sv.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="as vllm serve: the context length (default: the model's)",
    )

    pl = sub.add_parser("plan", help="plan a KV transfer on a topology", add_help=False)
    pl.add_argument("rest", nargs=argparse.REMAINDER)

    tm = sub.add_parser("tiny-model", help="write a tiny random Llama for tests and demos")
    tm.add_argument("dir")
    return parser


def parse_params(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        pol, dot, name = key.partition(".")
        if not sep or not dot or not pol or not name:
            raise CLIError(f"--param {item!r}: expected POLICY.KEY=VALUE")
        value: Any
        low = raw.strip().lower()
        if low in ("true", "false"):
            value = low == "true"
        else:
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    value = raw
        out.setdefault(pol, {})[name] = value
    return out


def check_params(policies: Sequence[str], params: dict[str, dict[str, Any]], profile: Any) -> None:
    """Build each policy once with its parameters, so a bad one fails before any run."""
    from wasma.scheduler.registry import default_registry

    reg = default_registry()
    for pol in policies:
        try:
            reg.check(pol, params.get(pol, {}), profile)
        except ValueError as exc:
            raise CLIError(f"--param: {exc}") from None


def _cmd_trace_gen(args: argparse.Namespace) -> int:
    from wasma.benchmarks.apps import generate
    from wasma.core.profile import load_profile
    from wasma.scheduler.trace import write_trace

    profile = load_profile(args.profile)
    wfs = generate(
        args.app, args.workflows, args.rate, args.seed, profile, args.slack, args.token_scale
    )
    too_long = [
        f"{w.workflow_id}/{n}"
        for w in wfs
        for n in w.nodes
        if w.prompt_tokens(n) + w.nodes[n].output_tokens > profile.max_model_len
    ]
    if too_long:
        raise CLIError(
            f"{len(too_long)} requests (first: {too_long[0]}) exceed the {profile.name} "
            f"profile's max_model_len {profile.max_model_len}; lower --token-scale"
        )
    write_trace(args.output, wfs)
    nodes = sum(len(w) for w in wfs)
    print(f"wrote {len(wfs)} workflows ({nodes} requests) to {args.output}")
    return 0


def _cmd_trace_import(args: argparse.Namespace) -> int:
    from wasma.benchmarks.trace_io import read_requests, to_workflows
    from wasma.core.profile import load_profile
    from wasma.scheduler.trace import write_trace

    if args.sessions and args.format != "mooncake":
        raise CLIError("--sessions needs --format mooncake (Azure traces carry no content)")
    profile = load_profile(args.profile)
    reqs = read_requests(args.format, args.file)
    wfs, dropped = to_workflows(reqs, profile, args.slack, sessions=args.sessions)
    if not wfs:
        raise CLIError(f"every request exceeds the {profile.name} profile's max_model_len")
    write_trace(args.output, wfs)
    note = f"; dropped {dropped} over max_model_len {profile.max_model_len}" if dropped else ""
    nodes = sum(len(w) for w in wfs)
    turns = f" ({nodes} requests)" if args.sessions else ""
    print(f"wrote {len(wfs)} workflows{turns} to {args.output}{note}")
    return 0


def _cmd_trace_export(args: argparse.Namespace) -> int:
    from wasma.benchmarks.trace_io import to_mooncake, write_mooncake
    from wasma.scheduler.trace import load_trace

    records = to_mooncake(load_trace(args.file))
    write_mooncake(args.output, records)
    print(f"wrote {len(records)} requests to {args.output}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from wasma.benchmarks.bench import bench
    from wasma.benchmarks.report import table
    from wasma.core.profile import load_profile
    from wasma.scheduler.registry import default_registry
    from wasma.scheduler.trace import load_trace

    if not args.rates and not args.sweep:
        args.rates = [1.0]
    known = default_registry().names()
    for p in args.policies:
        if p not in known:
            raise CLIError(f"--policies: unknown policy {p!r}; choose from: {', '.join(known)}")
    profile = load_profile(args.profile)  # fail fast on a bad profile
    for t in args.trace:
        # Fail fast, with file:line, before spawning workers; and on requests the profile's
        # engines would reject mid-run.
        for wf in load_trace(t):
            for n, node in wf.nodes.items():
                total = wf.prompt_tokens(n) + node.output_tokens
                if total > profile.max_model_len:
                    raise CLIError(
                        f"{t}: workflow {wf.workflow_id!r}, node {n!r}: {total} prompt+output "
                        f"tokens exceed max_model_len {profile.max_model_len} of profile "
                        f"{profile.name!r}"
                    )
    topology = _topology_preset(args.topology)
    params = parse_params(args.param)
    for pol in params:
        if pol not in args.policies:
            raise CLIError(f"--param for {pol!r}, which is not in --policies")
    check_params(args.policies, params, load_profile(args.profile))
    results = bench(
        [str(Path(t)) for t in args.trace],
        args.policies,
        args.engines,
        args.profile,
        args.rates,
        args.sweep,
        args.out,
        workers=args.workers,
        ray_address=args.address,
        params=params,
        dags=not args.no_dags,
        topology=topology,
        cpu_tier_gib=args.cpu_tier_gib or 0.0,
        cut_short=not args.full_probes,
    )
    print(table(results))
    print(f"results: {Path(args.out) / 'results.json'}; plots: goodput.png, p95_latency.png")
    return 0


def _topology_preset(value: str) -> str:
    """`preset:NAME` (or NAME) of a topology preset, as `wasma bench --topology` takes it."""
    from wasma.transfer.presets import SHAPES

    name = value.removeprefix("preset:")
    if name not in SHAPES:
        raise CLIError(
            f"--topology: unknown preset {value!r}; choose from: "
            + ", ".join(f"preset:{n}" for n in sorted(SHAPES))
        )
    return name


def _cmd_plan(args: argparse.Namespace) -> int:
    from wasma.transfer.cli import plan_main

    return plan_main(list(args.rest))


def _cmd_serve(args: argparse.Namespace) -> int:
    if args.ray_serve:
        from wasma.ray_serve.serve import serve_ray

        return serve_ray(args)
    from wasma.deploy.serve import serve_main

    return serve_main(args)


def _cmd_replay(args: argparse.Namespace) -> int:
    from wasma.benchmarks.replay import replay_main

    return replay_main(args)


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from wasma.engines.tiny_model import write_tiny_model

    path = write_tiny_model(args.dir)
    print(f"wrote a tiny random Llama to {path} (its text is noise; it exists to exercise vLLM)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # a small output's write fails here, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (`wasma plan ... | head`): stop quietly, as Unix tools do.
        # Point stdout at /dev/null so the interpreter's final flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, what a shell reports for a killed writer


def _main(argv: Sequence[str] | None = None) -> int:
    from wasma.core.profile import ProfileError
    from wasma.scheduler.registry import UnknownPolicy
    from wasma.scheduler.trace import TraceError
    from wasma.scheduler.workflow import WorkflowError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        # The planner owns its flags; argparse's REMAINDER cannot forward leading options.
        from wasma.transfer.cli import plan_main

        return plan_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {
        "bench": _cmd_bench,
        "plan": _cmd_plan,
        "serve": _cmd_serve,
        "replay": _cmd_replay,
        "tiny-model": _cmd_tiny_model,
    }
    try:
        if args.command == "trace":
            trace_cmds = {"import": _cmd_trace_import, "export": _cmd_trace_export}
            return trace_cmds.get(args.trace_command, _cmd_trace_gen)(args)
        return handlers[args.command](args)
    except (CLIError, TraceError, WorkflowError, ProfileError, UnknownPolicy) as exc:
        print(f"wasma: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"wasma: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # a closed reader, handled quietly by main
    except OSError as exc:
        print(f"wasma: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
