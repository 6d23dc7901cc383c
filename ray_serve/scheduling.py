"""The scheduling state every ingress replica's `WorkflowRouter` shares.

Ray Serve builds one request router per deployment handle, so each ingress replica has
its own; Ray's `PrefixCacheAffinityRouter` shares one prefix tree through a detached
actor, and wasma does the same with its whole scheduling core: the router, the policy,
the workflow registry, the prefix index and the engines' loads live here, in one
`SchedulingState` that runs as a Ray actor (`SchedulingActor`).

Prompts are placed on token blocks, as everywhere in wasma: the state renders a chat or
completion request with vLLM's own renderer over the model's tokenizer and chat template
(the ids the replica's engine will cache, tools and all), hashes its full blocks with the
chain hash the gateway uses (`core.tokens.hash_token_blocks`) and, once a replica
is chosen, records those blocks as that replica's (the replica will hold them once it
runs the prompt; vLLM's prefix cache keeps them). Replicas are engines named by their
Serve replica id; the set follows what Serve offers each decision.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wasma.core.events import BlockStored
from wasma.core.profile import load_profile
from wasma.core.tokens import hash_token_blocks
from wasma.deploy.api import ApiAnswer, Rendered, render
from wasma.deploy.frontend import Frontend, FrontendOptions
from wasma.deploy.metadata import MetadataError, workflow_identity
from wasma.scheduler.dispatch import ANONYMOUS_PREFIX, Dispatcher, DispatcherConfig

# Decisions remembered for the ingress to read back (x-wasma-engine): far more than are
# ever in flight, so an answer's headers always find theirs.
KEEP_DECISIONS = 100_000
# Agents do not say when a run ends: a live workflow idle this long is closed.
IDLE_WORKFLOW_S = 600.0


@dataclass(frozen=True, slots=True)
class Decision:
    replica: str  # Serve's full replica id
    placement: str  # reuse | transfer | recompute
    workflow_id: str
    node_id: str
    request_id: str


class SchedulingState:
    """wasma's scheduling core over Serve replicas: place, and hear back finishes."""

    def __init__(
        self,
        policy: str = "wasma",
        profile: str = "tiny-cpu",
        model: str | None = None,
        params: Mapping[str, Any] | None = None,
        block_size: int | None = None,
        frontend: Mapping[str, Any] | None = None,
    ) -> None:
        prof = load_profile(profile)
        self.block_size = block_size or prof.block_size
        if model is None:
            # No model named (a state built outside Serve): the tiny local model's
            # tokenizer and template, as `wasma serve --engines sim:N` renders with.
            from wasma.deploy.serve import SIM_MODEL_DIR
            from wasma.engines.tiny_model import write_tiny_model

            model = str(write_tiny_model(str(Path(SIM_MODEL_DIR).expanduser())))
        flags = dict(frontend or {})
        self.frontend = Frontend.build_sync(
            FrontendOptions(
                model=model,
                tool_call_parser=flags.get("tool_call_parser"),
                reasoning_parser=flags.get("reasoning_parser"),
                chat_template=flags.get("chat_template"),
                enable_auto_tool_choice=bool(flags.get("enable_auto_tool_choice", False)),
                max_model_len=flags.get("max_model_len"),
            )
        )
        # The renderer is async; this state's methods run on a Ray actor's thread.
        self._loop = asyncio.new_event_loop()
        self.policy_name = policy
        # The one scheduling core every front end runs; replicas join as Serve offers them.
        self.dispatch = Dispatcher(
            [], prof, DispatcherConfig(policy=policy, params=dict(params or {}))
        )
        self.ctx = self.dispatch.ctx
        self.router = self.dispatch.router
        self._decisions: OrderedDict[str, Decision] = OrderedDict()
        self._by_internal: dict[str, str] = {}
        self._last_seen: dict[str, float] = {}
        self._t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self._t0

    def _sync_replicas(self, candidates: Sequence[str]) -> None:
        state = self.ctx.state
        known = set(state.engines)
        added = [c for c in candidates if c not in known]
        for name in added:
            state.add_engine(name)
            self.ctx.index.add_engine(name)
            self.ctx.inflight.add_engine(name)
            self.ctx.cpu_index.add_engine(name)
        if added:
            # Policies size their per-engine state when built: rebuild on a new replica
            # (the event-fed state, loads and workflows, lives in the context and stays).
            self.router.policy = self.dispatch.registry.create(self.policy_name, self.ctx)
        offered = set(candidates)
        for slot, load in enumerate(state.loads):
            state.set_healthy(slot, load.name in offered)

    def place(
        self,
        candidates: Sequence[str],
        request_id: str,
        internal_id: str,
        headers: Mapping[str, str],
        body: Mapping[str, Any],
    ) -> str | None:
        """The replica (one of `candidates`) for this request; None when it carries no
        prompt to place (the caller falls back to Serve's own choice). Bad workflow
        metadata raises `MetadataError`."""
        if not candidates:
            return None
        known = self._by_internal.get(internal_id)
        if known is not None and (d := self._decisions.get(known)) is not None:
            if d.replica in candidates:
                # Serve asks again when its pick was full or slow to answer: same answer,
                # charged once.
                return d.replica
            # Its replica went away before it was sent: release the charge, place anew.
            self.ctx.state.on_finish(internal_id)
        ident = workflow_identity(headers, body)
        rendered = self._render(body)
        if rendered is None:
            return None
        ids = rendered.token_ids
        self._sync_replicas(candidates)
        now = self.now()
        if ident.workflow_id is None:
            wkey, node = f"{ANONYMOUS_PREFIX}{request_id}", "0"
        else:
            wkey, node = ident.workflow_id, ident.node_id or request_id
        wst = self.dispatch.open_request(wkey, ident.app, ident.deadline_s, now, track=False)
        hashes = hash_token_blocks(ids, self.block_size)
        info = Dispatcher.request_info(
            internal_id,
            wkey,
            node,
            wst,
            len(ids),
            rendered.max_tokens,
            hashes,
            now,
            ident.parents,
        )
        # Serve has already chosen to send the request now: it is never held here.
        placement = self.dispatch.place(info, now, force=True).placement
        replica = self.ctx.state.loads[placement.engine].name
        if hashes:
            # The replica prefills these blocks and vLLM's prefix cache keeps them.
            self.dispatch.on_kv_event(BlockStored(replica, tuple(hashes), None))
        decision = Decision(replica, placement.kind.value, wkey, node, request_id)
        self._remember(request_id, internal_id, decision)
        self._last_seen[wkey] = now
        self._sweep(now)
        return replica

    def _render(self, body: Mapping[str, Any]) -> Rendered | None:
        """The request as vLLM's renderer gives it to the engine; None for a call with
        no prompt or a body vLLM refuses (the replica answers it with vLLM's error)."""
        kind = "chat" if "messages" in body else "completion" if "prompt" in body else None
        if kind is None:
            return None
        # The replica checks the model name; placement only needs the prompt's ids.
        data = {**body, "model": self.frontend.model_name}
        try:
            return self._loop.run_until_complete(render(self.frontend, kind, data))
        except ApiAnswer:
            return None

    def _remember(self, request_id: str, internal_id: str, decision: Decision) -> None:
        self._decisions[request_id] = decision
        self._by_internal[internal_id] = request_id
        while len(self._decisions) > KEEP_DECISIONS:
            self._decisions.popitem(last=False)

    def _sweep(self, now: float) -> None:
        for wkey, last in list(self._last_seen.items()):
            if now - last < IDLE_WORKFLOW_S:
                break  # oldest first: the rest are newer
            del self._last_seen[wkey]
            self.dispatch.close_live(wkey, last)

    def placement_of(self, request_id: str) -> tuple[str, str] | None:
        """(replica id, placement kind) of a request this state placed."""
        d = self._decisions.get(request_id)
        return None if d is None else (d.replica, d.placement)

    def completed(self, internal_id: str) -> None:
        """Serve finished (or failed) a request: its load leaves the replica, and its
        workflow's children may now follow it."""
        request_id = self._by_internal.pop(internal_id, None)
        if request_id is None:
            return
        d = self._decisions.get(request_id)
        if d is None:
            return
        self.dispatch.on_first_token(internal_id)
        self.dispatch.finish(internal_id, d.workflow_id, d.node_id, self.now())
        self.dispatch.release(d.workflow_id, self.now())
        self._last_seen.pop(d.workflow_id, None)
        self._last_seen[d.workflow_id] = self.now()

    def replica_died(self, replica: str) -> None:
        if replica in self.ctx.state.engines:
            self.ctx.state.set_healthy(self.ctx.state.slot(replica), False)
            self.ctx.index.remove_engine_blocks(replica)

    def decision_us(self) -> dict[str, float]:
        """p50 and p99 of the policy's own decision time (µs), for the router's budget."""
        times = sorted(self.router.decision_us)
        if not times:
            return {"p50": 0.0, "p99": 0.0, "n": 0.0}
        return {
            "p50": times[len(times) // 2],
            "p99": times[min(len(times) - 1, int(0.99 * len(times)))],
            "n": float(len(times)),
        }

    def loads(self) -> dict[str, int]:
        """Outstanding requests per replica, as the state counts them (for tests and
        dashboards)."""
        return {load.name: load.outstanding for load in self.ctx.state.loads}


__all__ = ["Decision", "MetadataError", "SchedulingState"]
