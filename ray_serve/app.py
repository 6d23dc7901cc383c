"""`build_openai_app`: Ray Serve LLM's builder, with wasma deciding where requests run.

A Ray Serve LLM user switches by changing one import:

    from wasma.ray_serve import build_openai_app   # was: from ray.serve.llm import ...
    serve.run(build_openai_app({"llm_configs": [llm_config]}))

Every model's `LLMServer` deployment gets `WorkflowRouter` (its own scheduling actor,
reading the model's tokenizer, block size and the policy), and the ingress becomes
`WasmaIngress`. Everything else is Ray's builder, unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray.llm._internal.serve.core.ingress.builder import LLMServingArgs
from ray.llm._internal.serve.core.ingress.builder import (
    build_openai_app as ray_build_openai_app,
)
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from wasma.ray_serve.ingress import WasmaIngress
from wasma.ray_serve.router import WorkflowRouter
from wasma.scheduler.registry import default_registry

# The engine flags that change how vLLM renders a prompt: the scheduling state renders
# with the same ones, so it hashes the ids the replicas' engines cache.
FRONTEND_FLAGS = (
    "tool_call_parser",
    "reasoning_parser",
    "chat_template",
    "enable_auto_tool_choice",
    "max_model_len",
)


def frontend_flags(engine_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: engine_kwargs[k] for k in FRONTEND_FLAGS if engine_kwargs.get(k) is not None}


def state_name(model_id: str) -> str:
    return f"WasmaScheduling::{model_id}"


def build_openai_app(
    llm_serving_args: Mapping[str, Any] | LLMServingArgs,
    policy: str = "wasma",
    profile: str = "tiny-cpu",
    params: Mapping[str, Any] | None = None,
) -> Application:
    """Ray's `build_openai_app(llm_serving_args)`; `policy` (any name in wasma's
    registry), `profile` and `params` choose how `WorkflowRouter` decides (or, from a
    Serve config file, `args.wasma: {policy, profile, params}`)."""
    if isinstance(llm_serving_args, LLMServingArgs):
        args = llm_serving_args
    else:
        raw = dict(llm_serving_args)
        # A Serve config file (KubeRay's serveConfigV2) can only pass one `args` mapping:
        # wasma's own settings ride in it under `wasma`.
        own = raw.pop("wasma", None) or {}
        if not isinstance(own, Mapping) or set(own) - {"policy", "profile", "params"}:
            raise ValueError("args.wasma takes only policy, profile and params")
        policy = own.get("policy", policy)
        profile = own.get("profile", profile)
        params = own.get("params", params)
        args = LLMServingArgs.model_validate(raw)
    if policy not in default_registry().names():
        known = ", ".join(default_registry().names())
        raise ValueError(f"unknown policy {policy!r}; choose from: {known}")
    names: dict[str, str] = {}
    configs: list[Any] = list(args.llm_configs)  # validated: LLMConfig objects
    for cfg in configs:
        block_size = cfg.engine_kwargs.get("block_size")
        kwargs = {
            "policy": policy,
            "profile": profile,
            "model": cfg.model_loading_config.model_source,
            "params": dict(params or {}),
            "block_size": block_size if isinstance(block_size, int) else None,
            "frontend": frontend_flags(cfg.engine_kwargs),
            "state_name": state_name(cfg.model_id),
        }
        dep = dict(cfg.deployment_config or {})
        dep["request_router_config"] = RequestRouterConfig(
            request_router_class=WorkflowRouter,  # type: ignore[arg-type]  # a class or its path
            request_router_kwargs=kwargs,
        )
        cfg.deployment_config = dep
        names[cfg.model_id] = state_name(cfg.model_id)
    ingress: Any = args.ingress_cls_config  # validated: an IngressClsConfig
    ingress.ingress_cls = WasmaIngress
    ingress.ingress_extra_kwargs = {
        **(ingress.ingress_extra_kwargs or {}),
        "wasma_state_names": names,
    }
    return ray_build_openai_app(args)  # type: ignore[arg-type]  # it validates its input
