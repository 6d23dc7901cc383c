"""`WorkflowRouter`: wasma's placement as a Ray Serve request router.

Set it on an `LLMServer` deployment the way Ray's own routers are set:

    llm_config = LLMConfig(..., deployment_config={"request_router_config": {
        "request_router_class": "wasma.ray_serve.router:WorkflowRouter",
        "request_router_kwargs": {"model": "/models/llama", "policy": "wasma"}}})

(`wasma.ray_serve.build_openai_app` does it for every model). Serve builds one router
per deployment handle, in each ingress replica; every one of them asks the same
`SchedulingActor` (named per deployment, detached, cleaned up by `serve.shutdown`), so
all ingresses decide on one view of workflows, prefixes and loads, as Ray's
`PrefixCacheAffinityRouter` shares its prefix tree.

The request is the ingress's call `(body, RawRequestInfo)`: the body is the OpenAI
request (messages or prompt, `metadata`, `vllm_xargs`), or the Responses / Messages body
as the client sent it, and the raw request's headers carry `x-wasma-*`, the framework
session headers and `x-request-id`. The call's method says what the body is (`CALL_KINDS`);
the others (embeddings, tokenize, count_tokens...) are left to Serve's own pick.
"""

from __future__ import annotations

import importlib
import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.serve._private.common import DeploymentID
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from wasma.ray_serve.scheduling import MetadataError, SchedulingState

logger = logging.getLogger("ray.serve")

# Decisions a router keeps for its ingress to read (x-wasma-engine) without asking the
# state again: each is read once, as its answer goes out; far more than are in flight.
KEEP_PLACED = 10_000


class _ActorSchedulingState(SchedulingState):
    """`SchedulingState` in an actor process of its own, whose startup heap (vLLM's
    renderer, torch, the tokenizer) is frozen once built, as vLLM's servers freeze
    theirs: the collector then walks only what requests allocate."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()


# Ray runs the shared state as an actor with no CPU of its own (like Ray's prefix tree):
# it must not take a core from the replicas' placement groups.
SchedulingActor = ray.remote(num_cpus=0)(_ActorSchedulingState)


def scheduling_actor(
    deployment: DeploymentID,
    policy: str = "wasma",
    profile: str = "tiny-cpu",
    model: str | None = None,
    params: Mapping[str, Any] | None = None,
    block_size: int | None = None,
    state_name: str | None = None,
    state_actor: ActorHandle | None = None,
    frontend: Mapping[str, Any] | None = None,
) -> Any:
    """The `SchedulingActor` of `deployment`, from `WorkflowRouter`'s kwargs: `state_actor`
    where given, else the one named `state_name` (by default after the deployment),
    created with these settings if it does not run yet (by the first ingress router or
    `WasmaLLMServer` replica to ask) and stopped by `serve.shutdown`. Typed Any: its
    methods are Ray's remote wrappers."""
    if state_actor is not None:
        return state_actor
    name = state_name or f"WasmaScheduling::{deployment.app_name}::{deployment.name}"
    # Outside any placement group: created from a replica, it would otherwise be captured
    # by that replica's group and die with it (Ray removes a killed replica's group).
    # Ray documents `placement_group=None` as "explicitly not in one"; its hint says
    # PlacementGroup only (tests/ray_serve/test_state_actor.py checks the behaviour).
    outside = PlacementGroupSchedulingStrategy(placement_group=None)  # type: ignore[arg-type]
    state = SchedulingActor.options(
        name=name,
        namespace=SERVE_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        scheduling_strategy=outside,
    ).remote(policy, profile, model, dict(params or {}), block_size, dict(frontend or {}))
    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        controller._register_shutdown_cleanup_actor.remote(state)
    except ValueError:  # no Serve controller (a router built outside Serve)
        pass
    return state


def workflow_router_kwargs(deployment_config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The `request_router_kwargs` of a deployment routed by `WorkflowRouter` (or a
    subclass), None for any other router. `request_router_config` is Serve's
    `RequestRouterConfig` or, from a config file, its fields."""
    from ray.serve.config import RequestRouterConfig

    config = deployment_config.get("request_router_config")
    if isinstance(config, Mapping):
        config = RequestRouterConfig(**config)
    if not isinstance(config, RequestRouterConfig):
        return None
    # By its import path: the class Serve cloudpickled with the config may come back as a
    # copy made by value, which is no subclass of this module's `WorkflowRouter`.
    path = config.request_router_class
    if not isinstance(path, str):
        path = f"{path.__module__}.{path.__qualname__}"
    module, _, name = path.replace(":", ".").rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    if not (isinstance(cls, type) and issubclass(cls, WorkflowRouter)):
        return None
    return dict(config.request_router_kwargs or {})


# The server methods wasma places, and the kind of request each one's body is.
CALL_KINDS = {
    "chat": "chat",
    "completions": "completion",
    "responses": "responses",
    "anthropic_messages": "messages",
}
# Calls about a stored response (`{"response_id": ...}`): only the replica whose vLLM
# store holds it can answer.
STORE_CALLS = frozenset({"retrieve_responses", "cancel_responses"})
# The body field that holds the prompt, by kind (no kind: messages or prompt).
PROMPT_FIELDS = {
    "chat": ("messages",),
    "completion": ("prompt",),
    "responses": ("input",),
    "messages": ("messages",),
}


def request_parts(
    pending: PendingRequest, kind: str | None = None
) -> tuple[dict[str, str], dict[str, Any]] | None:
    """(headers, body fields) of an ingress call of `kind` (a `CALL_KINDS` value), or
    None for a call that is not one (e.g. Serve's health checks, a handle called with
    other arguments, a body with no prompt)."""
    if not pending.args:
        return None
    body = pending.args[0]
    raw = pending.args[1] if len(pending.args) > 1 else pending.kwargs.get("raw_request_info")
    headers = getattr(raw, "headers", None) or {}
    fields: dict[str, Any]
    if isinstance(body, Mapping):
        fields = dict(body)
    else:
        # vLLM's request model: every field the client set (tools, response_format...)
        # and the unknown ones it keeps (`metadata`, `vllm_xargs`), so the scheduling
        # state renders the prompt exactly as the replica's engine will.
        dump = getattr(body, "model_dump", None)
        fields = dump(exclude_unset=True) if callable(dump) else {}
    if isinstance(fields.get("messages"), list):
        fields["messages"] = [_plain(m) for m in fields["messages"]]
    if not any(f in fields for f in PROMPT_FIELDS.get(kind or "", ("messages", "prompt"))):
        return None
    return {str(k).lower(): str(v) for k, v in dict(headers).items()}, fields


def _plain(message: Any) -> Any:
    if isinstance(message, Mapping):
        return dict(message)
    dump = getattr(message, "model_dump", None)
    return dump() if callable(dump) else message


class WorkflowRouter(RequestRouter):
    """Places each request where wasma's policy says; Serve's pick when it cannot."""

    def initialize_state(  # type: ignore[override]  # Serve passes request_router_kwargs
        self,
        policy: str = "wasma",
        profile: str = "tiny-cpu",
        model: str | None = None,
        params: Mapping[str, Any] | None = None,
        block_size: int | None = None,
        state_name: str | None = None,
        state_actor: ActorHandle | None = None,
        frontend: Mapping[str, Any] | None = None,
    ) -> None:
        self._state: Any = scheduling_actor(
            self._deployment_id,
            policy,
            profile,
            model,
            params,
            block_size,
            state_name,
            state_actor,
            frontend,
        )
        # (replica id, placement kind) by request id, for `placement_of`.
        self._placed: OrderedDict[str, tuple[str, str]] = OrderedDict()

    def placement_of(self, request_id: str) -> tuple[str, str] | None:
        """The decision this router got for `request_id` (once: it is forgotten here),
        as the state's `placement_of` answers; None when it placed no such request."""
        return self._placed.pop(request_id, None)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        meta = pending_request.metadata
        if meta.call_method in STORE_CALLS:
            return await self._holder_of(candidate_replicas, pending_request)
        kind = CALL_KINDS.get(meta.call_method)
        parts = request_parts(pending_request, kind) if kind is not None else None
        if parts is None:
            return [candidate_replicas]
        headers, body = parts
        request_id = headers.get("x-request-id") or meta.request_id
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        try:
            # One call places and answers the placement kind: the ingress reads it from
            # this router (`placement_of`), in its own process.
            decided = await self._state.decide.remote(
                list(by_id), request_id, meta.internal_request_id, headers, body, kind
            )
        except MetadataError as exc:  # the ingress rejects these first; never fatal here
            logger.warning("wasma: %s", exc)
            return [candidate_replicas]
        if decided is None:
            return [candidate_replicas]
        self._placed[request_id] = (decided[0], decided[1])
        self._placed.move_to_end(request_id)
        while len(self._placed) > KEEP_PLACED:
            self._placed.popitem(last=False)
        replica = by_id.get(decided[0])
        if replica is None:
            return [candidate_replicas]
        return [[replica]]

    async def _holder_of(
        self, candidates: list[RunningReplica], pending: PendingRequest
    ) -> list[list[RunningReplica]]:
        """The replica that answered the response a store call names (any replica when
        none is known: it answers vLLM's 404)."""
        body = pending.args[0] if pending.args else None
        response_id = body.get("response_id") if isinstance(body, Mapping) else None
        if not isinstance(response_id, str):
            return [candidates]
        holder = await self._state.holder_of.remote(response_id)
        by_id = {r.replica_id.to_full_id_str(): r for r in candidates}
        return [[by_id[holder]]] if holder in by_id else [candidates]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._state.completed.remote(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._state.replica_died.remote(replica_id.to_full_id_str())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new replica set: a replica it no longer lists (dead as its controller
        found, or scaled down) is dropped from the state, with its KV subscription."""
        gone = set(self.curr_replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self._state.replica_died.remote(replica_id.to_full_id_str())


def handle_router(handle: Any) -> WorkflowRouter | None:
    """The `WorkflowRouter` Serve built in this process for deployment handle `handle`
    (shared by the handles `.options()` derives from it), or None: another router, none
    built yet, or a Serve whose handles are laid out otherwise. Serve keeps it behind
    the handle's private router; reading it there spares an actor call a request."""
    router = getattr(getattr(handle, "_router", None), "_asyncio_router", None)
    # The attribute, not the `request_router` property: that one would build a router.
    request_router = getattr(router, "_request_router", None)
    # By duck type: the class Serve built may be a by-value copy of this module's.
    if callable(getattr(request_router, "placement_of", None)) and hasattr(
        request_router, "_placed"
    ):
        return request_router
    return None


async def placement_of(handle: Any, state: Any, request_id: str) -> tuple[str, str] | None:
    """(replica id, placement kind) of request `request_id`, sent through `handle`: from
    the handle's `WorkflowRouter` in this process where it placed it, else from the
    scheduling actor `state` (one round trip)."""
    router = handle_router(handle)
    placed = router.placement_of(request_id) if router is not None else None
    if placed is None and state is not None:
        placed = await state.placement_of.remote(request_id)
    return None if placed is None else (str(placed[0]), str(placed[1]))
