"""`build_openai_app`: Ray Serve LLM's builder, with wasma deciding where requests run.

A Ray Serve LLM user switches by changing one import:

    from wasma.ray_serve import build_openai_app   # was: from ray.serve.llm import ...
    serve.run(build_openai_app({"llm_configs": [llm_config]}))

Every model's server becomes `WasmaLLMServer` (Ray's `LLMServer` that also answers the
Responses and Messages APIs) with `WorkflowRouter` (its own scheduling actor, reading the
model's tokenizer, block size and the policy), and the ingress becomes `WasmaIngress`
with Ray's routes plus `/v1/responses`, `/v1/messages` and `/v1/messages/count_tokens`.
The deployments are built by Ray's own builders (`build_llm_deployment`,
`make_fastapi_ingress`), as Ray's `build_openai_app` builds them; only the ingress's route
map is wasma's, which Ray's `build_openai_app` takes no argument for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.llm._internal.common.dict_utils import maybe_apply_llm_deployment_config_defaults
from ray.llm._internal.serve.constants import RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING
from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
from ray.llm._internal.serve.core.ingress.builder import LLMServingArgs
from ray.llm._internal.serve.core.ingress.ingress import make_fastapi_ingress
from ray.llm._internal.serve.core.server.builder import build_llm_deployment
from ray.llm._internal.serve.core.server.llm_server import LLMServer
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application
from ray.serve.llm.deployment import LLMServer as PublicLLMServer

from wasma.ray_serve.ingress import WASMA_ENDPOINTS, WasmaIngress
from wasma.ray_serve.router import WorkflowRouter
from wasma.ray_serve.server import WasmaLLMServer
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
    if RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING:
        # Ray's direct streaming makes the server its own ingress: no WasmaIngress.
        raise ValueError("wasma's ingress needs RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING unset")
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
        server = cfg.server_cls
        if server is None or server in (LLMServer, PublicLLMServer):
            # Ray's own server: wasma's is it, plus the routes Ray's lacks.
            cfg.server_cls = WasmaLLMServer
        elif not (isinstance(server, type) and issubclass(server, WasmaLLMServer)):
            raise ValueError(
                f"server_cls {server!r}: wasma's Responses and Messages routes need "
                "WasmaLLMServer or a subclass of it"
            )
        names[cfg.model_id] = state_name(cfg.model_id)
    ingress: Any = args.ingress_cls_config  # validated: an IngressClsConfig
    if ingress.ingress_cls is not WasmaIngress and not issubclass(
        ingress.ingress_cls, WasmaIngress
    ):
        ingress.ingress_cls = WasmaIngress
    extra = {**(ingress.ingress_extra_kwargs or {}), "wasma_state_names": names}
    # What Ray's `build_openai_app` does after validating, with wasma's route map.
    deployments = {c.model_id: build_llm_deployment(c) for c in configs}
    cards = {c.model_id: to_model_metadata(c.model_id, c) for c in configs}
    lora_paths = {
        c.model_id: c.lora_config.dynamic_lora_loading_path
        for c in configs
        if c.lora_config is not None
    }
    options = maybe_apply_llm_deployment_config_defaults(
        ingress.ingress_cls.get_deployment_options(configs), args.ingress_deployment_config
    )
    cls = make_fastapi_ingress(ingress.ingress_cls, endpoint_map=WASMA_ENDPOINTS)
    deployment: Any = serve.deployment(cls, **options)
    return deployment.bind(
        llm_deployments=deployments, model_cards=cards, lora_paths=lora_paths, **extra
    )
