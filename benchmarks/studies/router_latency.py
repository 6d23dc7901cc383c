"""What each Ray Serve request router's own decision costs per request, on the same
replicas, in one process: Ray's `PowerOfTwoChoicesRequestRouter` (Serve's default) and
`PrefixCacheAffinityRouter` (its prefix-tree actor), and wasma's `WorkflowRouter` (its
`SchedulingState` actor), with nothing else between them.

    python -m wasma.benchmarks.studies.router_latency [--requests 300] [--out FILE]

Each router routes one Serve app of two trivial replicas (an async method that returns
at once: no engine, so only the routing path differs), called through a deployment
handle from this process as Ray's OpenAI ingress calls its `LLMServer`s: `chat(body,
RawRequestInfo)`, the body vLLM's `ChatCompletionRequest`. Requests are chats of 8
workflows whose conversations grow a turn a request (~900 to ~3500 tokens of the tiny
model's tokenizer, under its 4096-token context), sent one at a time, the routers
interleaved request by request (the order rotated each round), every router the same
bodies.

Per request, timed around the handle's own router instance (Serve builds it in this
process, as it does in each ingress replica): `choose_replicas` (the router's decision;
for Ray's prefix router its tree-actor calls and queue-length probes), its
`on_request_routed` hook (Ray's prefix router inserts the prompt into its tree there,
blocking), and for wasma the decision read back as `WasmaIngress` does for the
`x-wasma-*` headers (Ray's ingress does no such call). `decision` is their sum; `call`
is the whole handle call (routing, Serve's queue-length probe, the replica's no-op).
`wasma` reads the decision from the handle's own `WorkflowRouter`, in this process, as
`WasmaIngress` does; `wasma_actor` (a second app, with its own state) asks the state
actor for it instead, one more round trip: the ingress's path before it read the router.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# `wasma_actor`: `WorkflowRouter` with its decision read back from the state actor (a
# second round trip a request), as `WasmaIngress` did before it read its router's.
ROUTERS = ("pow2", "prefix", "wasma", "wasma_actor")
WASMA = ("wasma", "wasma_actor")
WORKFLOWS = 8
BLOCK = 32
# A conversation restarts (a new workflow run) once its prompt passes this many words.
MAX_WORDS = 650
TEXT = (
    "the planner reads each step of the plan and asks the worker agent to check what "
    "its tool returned against the schema before the reviewer agent writes a summary "
    "of the findings with citations to the retrieved documents and a list of open "
    "questions for the next round of the debate between the two critics"
)


class Replica:
    """A replica that answers at once: what is timed is the routing."""

    async def chat(self, body: Any, raw: Any) -> int:
        return 0


@dataclass
class Timings:
    """Per router, one list of milliseconds per stage."""

    stages: dict[str, list[float]] = field(default_factory=dict)

    def add(self, stage: str, ms: float) -> None:
        self.stages.setdefault(stage, []).append(ms)


def _text(rng: random.Random, words: int) -> str:
    vocabulary = TEXT.split()
    return " ".join(rng.choice(vocabulary) for _ in range(words))


def conversations(n: int, seed: int = 0) -> list[tuple[str, list[dict[str, str]]]]:
    """n (workflow id, messages) requests: workflow i % WORKFLOWS's conversation, one
    turn longer each time (system prompt ~200-400 words, turns ~80-300 words)."""
    rng = random.Random(seed)
    convs: dict[int, list[dict[str, str]]] = {}
    runs = dict.fromkeys(range(WORKFLOWS), 0)
    out = []
    for i in range(n):
        w = i % WORKFLOWS
        conv = convs.get(w)
        if conv is None or sum(len(m["content"].split()) for m in conv) > MAX_WORDS:
            runs[w] += 1
            conv = [{"role": "system", "content": _text(rng, rng.randint(200, 400))}]
        else:
            conv = [*conv, {"role": "assistant", "content": _text(rng, rng.randint(80, 300))}]
        conv = [*conv, {"role": "user", "content": _text(rng, rng.randint(80, 300))}]
        convs[w] = conv
        out.append((f"wf{w}-{runs[w]}", conv))
    return out


def _timed(fn: Callable[..., Any], times: Timings, stage: str, is_async: bool) -> Any:
    """`fn` (a bound method of a router) timed into `times[stage]`."""
    if is_async:

        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                times.add(stage, (time.perf_counter() - t0) * 1e3)

        return timed_async

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.add(stage, (time.perf_counter() - t0) * 1e3)

    return timed


def deploy(router: str, model: str) -> Any:
    """App `router` (two `Replica`s behind that router); its handle once running."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter

    config: RequestRouterConfig | None = None
    if router == "prefix":
        config = RequestRouterConfig(
            request_router_class=PrefixCacheAffinityRouter  # type: ignore[arg-type]
        )
    elif router in WASMA:
        config = RequestRouterConfig(
            request_router_class="wasma.ray_serve.router:WorkflowRouter",  # type: ignore[arg-type]
            request_router_kwargs={"model": model, "block_size": BLOCK},
        )
    options: dict[str, Any] = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0}}
    if config is not None:
        options["request_router_config"] = config
    app = serve.deployment(name="Replica", **options)(Replica).bind()
    return serve.run(app, name=router, route_prefix=None)


async def measure(
    handles: dict[str, Any], model: str, requests: int, warmup: int, seed: int
) -> dict[str, Any]:
    import ray
    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest
    from ray.llm._internal.serve.core.protocol import RawRequestInfo
    from ray.serve._private.constants import SERVE_NAMESPACE

    from wasma.ray_serve.router import placement_of

    times = {r: Timings() for r in ROUTERS}
    states: dict[str, Any] = {}
    undecided = 0  # wasma requests with no decision to read back (Serve's own pick)
    reqs = conversations(warmup + requests, seed)
    for i, (workflow, messages) in enumerate(reqs):
        timed = i >= warmup
        if i == warmup:
            # Serve built each handle's router on its first request: time its stages.
            for r, handle in handles.items():
                rr = handle._router._asyncio_router.request_router
                rr.choose_replicas = _timed(rr.choose_replicas, times[r], "choose", True)
                rr.on_request_routed = _timed(rr.on_request_routed, times[r], "on_routed", False)
            states = {
                r: ray.get_actor(f"WasmaScheduling::{r}::Replica", namespace=SERVE_NAMESPACE)
                for r in WASMA
            }
        rnd = i - warmup
        if timed and rnd % 100 == 0:
            print(f"  round {rnd}/{requests}", flush=True)
        k = rnd % len(ROUTERS)
        order = ROUTERS[k:] + ROUTERS[:k]
        for r in order:
            request_id = uuid.uuid4().hex
            body = ChatCompletionRequest.model_validate(
                {"model": "tiny", "messages": messages, "max_tokens": 1}
            )
            headers = {"x-request-id": request_id, "x-wasma-workflow-id": workflow}
            t0 = time.perf_counter()
            await handles[r].chat.remote(body, RawRequestInfo(headers=headers))
            t1 = time.perf_counter()
            if r in WASMA:
                # WasmaIngress, once the answer came: the decision for its headers.
                state = states.get(r)
                if r == "wasma":
                    placed = await placement_of(handles[r], state, request_id)
                else:
                    placed = await state.placement_of.remote(request_id) if state else None
                if timed and placed is None:
                    undecided += 1
            t2 = time.perf_counter()
            if timed:
                times[r].add("call", (t1 - t0) * 1e3)
                if r in WASMA:
                    times[r].add("read_back", (t2 - t1) * 1e3)
    out: dict[str, Any] = {}
    for r in ROUTERS:
        st = times[r].stages
        n = len(st["call"])
        decision = [
            st["choose"][k]
            + (st["on_routed"][k] if "on_routed" in st else 0.0)
            + (st["read_back"][k] if "read_back" in st else 0.0)
            for k in range(n)
        ]
        out[r] = {name: _summary(v) for name, v in {**st, "decision": decision}.items()}
    out["wasma"]["undecided"] = undecided  # both wasma apps place the same requests
    # What the decision is made of: the policy's own time in the state actor (the render
    # is timed apart, in `main`).
    out["wasma"]["policy_us"] = await states["wasma"].decision_us.remote()
    out["tokens"] = _token_counts(model, [m for _, m in reqs[warmup:]])
    return out


def _summary(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {
        "n": len(s),
        "p50_ms": round(statistics.median(s), 3),
        "p95_ms": round(s[int(0.95 * (len(s) - 1))], 3),
        "mean_ms": round(statistics.fmean(s), 3),
    }


def _render_cost(model: str, prompts: list[list[dict[str, str]]]) -> dict[str, float]:
    """Milliseconds a `SchedulingState` takes to render and hash each prompt (and match
    its blocks against an empty index), run here: the part of wasma's decision that Ray's
    routers, which match text, do not have."""
    from wasma.ray_serve.scheduling import SchedulingState

    st = SchedulingState(model=model, block_size=BLOCK)
    bodies = [{"model": "tiny", "messages": m, "max_tokens": 1} for m in prompts]
    for b in bodies[:20]:
        st.cached_blocks(b, "chat")
    ms = []
    for b in bodies:
        t0 = time.perf_counter()
        st.cached_blocks(b, "chat")
        ms.append((time.perf_counter() - t0) * 1e3)
    return _summary(ms)


def _token_counts(model: str, prompts: list[list[dict[str, str]]]) -> dict[str, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    counts = sorted(
        len(tok.encode(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)))
        for m in prompts
    )
    return {"min": counts[0], "p50": counts[len(counts) // 2], "max": counts[-1]}


NAMES = {
    "pow2": "PowerOfTwoChoicesRequestRouter",
    "prefix": "PrefixCacheAffinityRouter",
    "wasma": "WorkflowRouter",
    "wasma_actor": "WorkflowRouter, read back from the actor",
}


def table(out: dict[str, Any]) -> str:
    def cell(r: str, stage: str) -> str:
        s = out[r].get(stage)
        return "—" if s is None else f"{s['p50_ms']:.2f} / {s['p95_ms']:.2f}"

    rows = [
        "| router | decision p50 / p95 ms | choose_replicas | on_request_routed "
        "| decision read back | whole handle call |",
        "|---|---|---|---|---|---|",
    ]
    for r in ROUTERS:
        stages = ("decision", "choose", "on_routed", "read_back", "call")
        rows.append(f"| `{NAMES[r]}` | " + " | ".join(cell(r, s) for s in stages) + " |")
    added = out["wasma"]["decision"]["p50_ms"] - out["prefix"]["decision"]["p50_ms"]
    rows.append(f"\nadded p50 decision latency, WorkflowRouter over prefix: {added:+.2f} ms")
    render = out["wasma"]["render"]
    rows.append(
        f"wasma's render of the same prompts, in-process: {render['p50_ms']:.2f} / "
        f"{render['p95_ms']:.2f} ms; its policy: {out['wasma']['policy_us']['p50']:.0f} us p50"
    )
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300, help="timed requests per router")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    ap.add_argument("--address", default=None, help="a running Ray cluster (default: start one)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.requests < 1 or args.warmup < 1:
        ap.error("--requests and --warmup must be at least 1")
    import ray
    from ray import serve

    from wasma.engines.tiny_model import write_tiny_model

    model = args.model
    if model is None:
        from wasma.deploy.serve import SIM_MODEL_DIR

        model = str(write_tiny_model(str(Path(SIM_MODEL_DIR).expanduser())))
    # The scheduling actor imports this checkout's wasma.
    env = {"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}}
    if args.address:
        ray.init(address=args.address, runtime_env=env)
    else:
        ray.init(num_cpus=2, include_dashboard=False, runtime_env=env)
    serve.start(proxy_location="Disabled")
    print(
        f"router_latency: {args.requests} requests x {len(ROUTERS)} routers "
        f"(+{args.warmup} warm-up), interleaved",
        flush=True,
    )
    t0 = time.monotonic()
    try:
        handles = {r: deploy(r, model) for r in ROUTERS}
        out = asyncio.run(measure(handles, model, args.requests, args.warmup, args.seed))
    finally:
        serve.shutdown()
    out["wall_s"] = round(time.monotonic() - t0, 1)
    # The render (vLLM's renderer, the tokenizer) of the same prompts, in this process.
    prompts = [m for _, m in conversations(args.warmup + args.requests, args.seed)]
    out["wasma"]["render"] = _render_cost(model, prompts[args.warmup :])
    print(table(out))
    print(f"prompt tokens: {out['tokens']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
