"""The scheduling state every ingress replica's `WorkflowRouter` shares.

Ray Serve builds one request router per deployment handle, so each ingress replica has
its own; Ray's `PrefixCacheAffinityRouter` shares one prefix tree through a detached
actor, and wasma does the same with its whole scheduling core: the router, the policy,
the workflow registry, the prefix index and the engines' loads live here, in one
`SchedulingState` that runs as a Ray actor (`SchedulingActor`).

Prompts are placed on token blocks, as everywhere in wasma: the state renders a chat
request with the model's own tokenizer and chat template, hashes its full blocks with the
chain hash the gateway uses (`scheduler.tokens.hash_token_blocks`) and, once a replica
is chosen, records those blocks as that replica's (the replica will hold them once it
runs the prompt; vLLM's prefix cache keeps them). Replicas are engines named by their
Serve replica id; the set follows what Serve offers each decision.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from wasma.deploy.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

from wasma.core.events import BlockStored
from wasma.core.profile import load_profile
from wasma.core.tokens import hash_token_blocks
from wasma.deploy.metadata import MetadataError, workflow_identity
from wasma.scheduler import (
    ClusterState,
    PolicyContext,
    PrefixIndex,
    RequestInfo,
    Router,
    WorkflowRegistry,
    default_registry,
)

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


def prompt_of(body: Mapping[str, Any]) -> list[dict[str, str]] | str | list[int] | None:
    """The prompt of a chat or completion body: messages (text parts joined, as Ray's
    prefix router reads them), a prompt string, or token ids; None if it has none."""
    messages = body.get("messages")
    if isinstance(messages, list):
        out = []
        for m in messages:
            if isinstance(m, Mapping):
                out.append({"role": str(m.get("role", "user")), "content": _text(m.get("content"))})
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if isinstance(prompt[0], str):  # a batch of prompts shares the first's placement
            return prompt[0]
    return None


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(v) for v in value)
    if isinstance(value, Mapping):
        text = value.get("text")
        return text if isinstance(text, str) else _text(value.get("content"))
    return ""


class SchedulingState:
    """wasma's scheduling core over Serve replicas: place, and hear back finishes."""

    def __init__(
        self,
        policy: str = "wasma",
        profile: str = "tiny-cpu",
        model: str | None = None,
        params: Mapping[str, Any] | None = None,
        block_size: int | None = None,
    ) -> None:
        prof = load_profile(profile)
        self.block_size = block_size or prof.block_size
        self.tokenizer: Tokenizer = HFTokenizer(model) if model else ByteTokenizer()
        self.policy_name = policy
        self.ctx = PolicyContext(
            ClusterState([]), PrefixIndex([]), WorkflowRegistry(), prof, params=params or {}
        )
        self._registry = default_registry()
        self.router = Router(self.ctx, self._registry.create(policy, self.ctx), 100_000)
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
        if added:
            # Policies size their per-engine state when built: rebuild on a new replica
            # (the event-fed state, loads and workflows, lives in the context and stays).
            self.router.policy = self._registry.create(self.policy_name, self.ctx)
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
        prompt = prompt_of(body)
        if prompt is None:
            return None
        ids = self._tokens(prompt)
        self._sync_replicas(candidates)
        now = self.now()
        registry = self.ctx.workflows
        if ident.workflow_id is None:
            wkey, node = f"~{request_id}", "0"
        else:
            wkey, node = ident.workflow_id, ident.node_id or request_id
        wst = registry.get(wkey)
        if wst is not None and wst.finished_s is not None:
            registry.finished.pop(wkey, None)
            wst = None
        if wst is None:
            deadline = ident.deadline_s if ident.deadline_s is not None else math.inf
            wst = registry.ensure(wkey, ident.app or "default", now, deadline)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 256
        hashes = hash_token_blocks(ids, self.block_size)
        info = RequestInfo(
            request_id=internal_id,
            workflow_id=wkey,
            node_id=node,
            app=wst.app,
            prompt_tokens=len(ids),
            max_tokens=int(max_tokens) if isinstance(max_tokens, int) else 256,
            block_hashes=hashes,
            arrival_s=now,
            deadline_s=wst.deadline_s,
            parents=ident.parents,
        )
        placement = self.router.route(info, now, force=True)
        replica = self.ctx.state.loads[placement.engine].name
        if hashes:
            # The replica prefills these blocks and vLLM's prefix cache keeps them.
            self.router.on_kv_event(BlockStored(replica, tuple(hashes), None))
        decision = Decision(replica, placement.kind.value, wkey, node, request_id)
        self._remember(request_id, internal_id, decision)
        self._last_seen[wkey] = now
        self._sweep(now)
        return replica

    def _tokens(self, prompt: list[dict[str, str]] | str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.tokenizer.chat(prompt)
        return [int(t) for t in prompt]  # type: ignore[arg-type]

    def _remember(self, request_id: str, internal_id: str, decision: Decision) -> None:
        self._decisions[request_id] = decision
        self._by_internal[internal_id] = request_id
        while len(self._decisions) > KEEP_DECISIONS:
            self._decisions.popitem(last=False)

    def _sweep(self, now: float) -> None:
        registry = self.ctx.workflows
        for wkey, last in list(self._last_seen.items()):
            if now - last < IDLE_WORKFLOW_S:
                break  # oldest first: the rest are newer
            del self._last_seen[wkey]
            registry.close(wkey, last)

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
        self.router.on_first_token(internal_id)
        self.router.on_finish(internal_id, d.workflow_id, d.node_id, self.now())
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


__all__ = ["Decision", "MetadataError", "SchedulingState", "prompt_of"]
