"""The scheduling state every ingress replica's `WorkflowRouter` shares.

Ray Serve builds one request router per deployment handle, so each ingress replica has
its own; Ray's `PrefixCacheAffinityRouter` shares one prefix tree through a detached
actor, and wasma does the same with its whole scheduling core: the router, the policy,
the workflow registry, the prefix index and the engines' loads live here, in one
`SchedulingState` that runs as a Ray actor (`SchedulingActor`).

Prompts are placed on token blocks, as everywhere in wasma: the state renders a chat or
completion request with vLLM's own renderer over the model's tokenizer and chat template
(the ids the replica's engine will cache, tools and all) and hashes its full blocks with
the chain hash the gateway uses (`core.tokens.hash_token_blocks`). The prefix index is fed
by the replicas' own vLLM KV events, as the gateway's is: each `WasmaLLMServer` replica
asks for a KV event endpoint before its engine starts (`kv_events_endpoint`), the state
subscribes there (`kv_feeds.ReplicaKVFeeds`) and re-keys what the engine stores, evicts
and clears by the same chain hash (`engines.kv_events`). Replicas are engines named by
their Serve replica id; the set follows what Serve offers each decision.

Responses and Messages requests are rendered as vLLM's serving classes render them
(Responses: `instructions` and `input`, with the stored conversation of a
`previous_response_id`; Messages: `system` and `messages`). vLLM keeps a response in the
store of the replica that answered it, so a request naming a `previous_response_id` is
pinned to that replica, as a child of that response in its workflow.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from wasma.core.events import BlockStored
from wasma.core.profile import load_profile
from wasma.core.tokens import hash_token_blocks
from wasma.deploy.api import ApiAnswer, Rendered, parse_request, render
from wasma.deploy.frontend import Frontend, FrontendOptions
from wasma.deploy.metadata import MetadataError, workflow_identity
from wasma.ray_serve.kv_feeds import ReplicaKVFeeds
from wasma.scheduler.dispatch import ANONYMOUS_PREFIX, Dispatcher, DispatcherConfig

# Decisions remembered for the ingress to read back (x-wasma-engine): far more than are
# ever in flight, so an answer's headers always find theirs.
KEEP_DECISIONS = 100_000
# The request kinds this state places (the ingress's call methods map onto them).
PLACED_KINDS = ("chat", "completion", "responses", "messages")
# Agents do not say when a run ends: a live workflow idle this long is closed.
IDLE_WORKFLOW_S = 600.0


@dataclass(frozen=True, slots=True)
class Decision:
    replica: str  # Serve's full replica id
    placement: str  # reuse | transfer | recompute
    workflow_id: str
    node_id: str
    request_id: str


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt as the replica's vLLM will run it."""

    token_ids: list[int]
    max_tokens: int
    # Responses only: the chat messages vLLM built (what its store keeps for a
    # follow-up to extend).
    messages: list[Any] | None = None


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response a replica answered, as that replica's vLLM store keeps it."""

    replica: str
    workflow_id: str
    node_id: str
    messages: list[Any] | None  # vLLM's `msg_store` entry: the prompt's messages
    output: list[Any] | None  # its output items (None until it is complete)


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
        self._profile = prof
        self._params = dict(params or {})
        # The replicas' KV event subscriptions (opened as replicas ask for them); they
        # outlive `forget`, as the replicas and their engines do.
        self._kv_feeds: ReplicaKVFeeds | None = None
        self.forget()

    def forget(self) -> None:
        """Start over as a fresh deployment's state: no workflows, prefix blocks, loads
        or decisions (the renderer stays). For replicas whose prefix caches were just
        emptied (vLLM's `reset_prefix_cache`), with nothing in flight: a benchmark's
        cold start without restarting the replicas."""
        # The one scheduling core every front end runs; replicas join as Serve offers them.
        self.dispatch = Dispatcher(
            [], self._profile, DispatcherConfig(policy=self.policy_name, params=self._params)
        )
        self.ctx = self.dispatch.ctx
        self.router = self.dispatch.router
        self._decisions: OrderedDict[str, Decision] = OrderedDict()
        self._by_internal: dict[str, str] = {}
        # Responses: the messages each placed request rendered to, until it answers;
        # then the answered responses by id (bounded as the decisions are).
        self._conversations: OrderedDict[str, list[Any] | None] = OrderedDict()
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._last_seen: dict[str, float] = {}
        self._t0 = time.monotonic()
        # The replicas Serve offered the last decision.
        self._offered: set[str] = set()
        if self._kv_feeds is not None:
            # Subscribed replicas stay known to the new index: their events keep coming.
            self._add_replicas(list(self._kv_feeds.endpoints()))

    def now(self) -> float:
        return time.monotonic() - self._t0

    def _add_replicas(self, names: Sequence[str]) -> None:
        state = self.ctx.state
        known = set(state.engines)
        added = [c for c in dict.fromkeys(names) if c not in known]
        for name in added:
            state.add_engine(name)
            self.ctx.index.add_engine(name)
            self.ctx.inflight.add_engine(name)
            self.ctx.cpu_index.add_engine(name)
            if name not in self._offered:
                # Known before Serve offers it (it subscribed while its engine started).
                state.set_healthy(state.slot(name), False)
        if added:
            # Policies size their per-engine state when built: rebuild on a new replica
            # (the event-fed state, loads and workflows, lives in the context and stays).
            self.router.policy = self.dispatch.registry.create(self.policy_name, self.ctx)

    def _sync_replicas(self, candidates: Sequence[str]) -> None:
        self._offered = set(candidates)
        self._add_replicas(candidates)
        state = self.ctx.state
        for slot, load in enumerate(state.loads):
            state.set_healthy(slot, load.name in self._offered)

    def kv_events_endpoint(self, replica: str) -> str:
        """The ZMQ endpoint replica `replica`'s vLLM publishes its KV events to (bound
        here, on this state's node, for that replica alone). A replica asks once, before
        its engine starts; asking again means a new engine, with a fresh feed."""
        if self._kv_feeds is None:
            self._kv_feeds = ReplicaKVFeeds(self.block_size, _node_address())
        elif replica in self._kv_feeds:
            self.ctx.index.remove_engine_blocks(replica)
        endpoint = self._kv_feeds.open(replica)
        self._add_replicas([replica])
        return endpoint

    def _apply_kv_events(self) -> None:
        """What the replicas published since the last call, into the index."""
        if self._kv_feeds is None:
            return
        for event in self._kv_feeds.drain():
            self.dispatch.on_kv_event(event)

    def place(
        self,
        candidates: Sequence[str],
        request_id: str,
        internal_id: str,
        headers: Mapping[str, str],
        body: Mapping[str, Any],
        kind: str | None = None,
    ) -> str | None:
        """The replica (one of `candidates`) for this request of `kind` (one of
        `PLACED_KINDS`; None: chat or completion, by the body's fields); None when it
        carries no prompt to place (the caller falls back to Serve's own choice). Bad
        workflow metadata raises `MetadataError`."""
        decided = self.decide(candidates, request_id, internal_id, headers, body, kind)
        return None if decided is None else decided[0]

    def decide(
        self,
        candidates: Sequence[str],
        request_id: str,
        internal_id: str,
        headers: Mapping[str, str],
        body: Mapping[str, Any],
        kind: str | None = None,
    ) -> tuple[str, str] | None:
        """`place`, answering (replica, placement kind) as `placement_of` will: the
        router hands both to its ingress, which then needs no second call."""
        if not candidates:
            return None
        self._apply_kv_events()
        known = self._by_internal.get(internal_id)
        if known is not None and (d := self._decisions.get(known)) is not None:
            if d.replica in candidates:
                # Serve asks again when its pick was full or slow to answer: same answer,
                # charged once.
                return d.replica, d.placement
            # Its replica went away before it was sent: release the charge, place anew.
            self.ctx.state.on_finish(internal_id)
        ident = workflow_identity(headers, body)
        previous: StoredResponse | None = None
        if kind == "responses":
            prev_id = body.get("previous_response_id")
            previous = self._responses.get(prev_id) if isinstance(prev_id, str) else None
            if previous is not None and ident.workflow_id in (None, previous.workflow_id):
                # The previous response is this one's parent.
                ident = replace(
                    ident,
                    workflow_id=previous.workflow_id,
                    node_id=ident.node_id or request_id,
                    parents=tuple(dict.fromkeys((*ident.parents, previous.node_id))),
                    source="previous_response_id" if ident.workflow_id is None else ident.source,
                )
            if ident.workflow_id is None:
                # A conversation's first response: the workflow its follow-ups join.
                ident = replace(ident, workflow_id=f"resp-{request_id}", node_id=request_id)
        prompt = self._render(body, kind, previous)
        if prompt is None:
            return None
        ids = prompt.token_ids
        self._sync_replicas(candidates)
        pinned: int | None = None
        if previous is not None and previous.replica in candidates:
            # Only that replica's vLLM holds the previous response.
            pinned = self.ctx.state.slot(previous.replica)
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
            prompt.max_tokens,
            hashes,
            now,
            ident.parents,
            pinned,
        )
        # Serve has already chosen to send the request now: it is never held here.
        placement = self.dispatch.place(info, now, force=True).placement
        replica = self.ctx.state.loads[placement.engine].name
        if hashes and (self._kv_feeds is None or replica not in self._kv_feeds):
            # A replica that publishes no KV events (Ray's own `LLMServer` under this
            # router): the index's only feed is this placement (the replica prefills
            # these blocks and vLLM's prefix cache keeps them; evictions go unseen). A
            # subscribed replica needs no such hint for the moments before its engine
            # reports them: policies that read `ctx.inflight` (wasma's) count the prompt
            # there until the request completes, and the rest see what they see behind
            # the gateway, the engines' events alone.
            self.dispatch.on_kv_event(BlockStored(replica, tuple(hashes), None))
        decision = Decision(replica, placement.kind.value, wkey, node, request_id)
        self._remember(request_id, internal_id, decision)
        if kind == "responses":
            self._conversations[request_id] = prompt.messages
            while len(self._conversations) > KEEP_DECISIONS:
                self._conversations.popitem(last=False)
        self._last_seen[wkey] = now
        self._sweep(now)
        return replica, decision.placement

    def _render(
        self,
        body: Mapping[str, Any],
        kind: str | None = None,
        previous: StoredResponse | None = None,
    ) -> Prompt | None:
        """The request as vLLM's renderer gives it to the engine; None for a call with
        no prompt or a body vLLM refuses (the replica answers it with vLLM's error)."""
        if kind is None:
            kind = "chat" if "messages" in body else "completion" if "prompt" in body else None
        if kind not in PLACED_KINDS:
            return None
        # The replica checks the model name; placement only needs the prompt's ids.
        data = {**body, "model": self.frontend.model_name}
        try:
            # This thread waits for the render whatever runs it, so it runs here: the
            # renderer's thread pool would only add two hand-offs.
            with self.frontend.inline(0):
                if kind == "responses":
                    return self._loop.run_until_complete(
                        render_responses(self.frontend, data, previous)
                    )
                rendered: Rendered = self._loop.run_until_complete(
                    render(self.frontend, kind, data)
                )
        except ApiAnswer:
            return None
        return Prompt(rendered.token_ids, rendered.max_tokens)

    def responded(self, request_id: str, response: Mapping[str, Any]) -> None:
        """A Responses answer (vLLM's response object) for request `request_id` is
        complete: a request naming its id as `previous_response_id` goes to the same
        replica, rendered after its conversation."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.responses.protocol import ResponsesResponse

        d = self._decisions.get(request_id)
        response_id = response.get("id")
        if d is None or not isinstance(response_id, str):
            return
        try:
            output: list[Any] | None = list(ResponsesResponse.model_validate(response).output)
        except ValidationError:
            output = None
        self._responses[response_id] = StoredResponse(
            d.replica, d.workflow_id, d.node_id, self._conversations.pop(request_id, None), output
        )
        while len(self._responses) > KEEP_DECISIONS:
            self._responses.popitem(last=False)

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

    def holder_of(self, response_id: str) -> str | None:
        """The replica whose vLLM store holds response `response_id`, if this state saw
        it answered."""
        stored = self._responses.get(response_id)
        return None if stored is None else stored.replica

    def placement_of(self, request_id: str) -> tuple[str, str] | None:
        """(replica id, placement kind) of a request this state placed."""
        d = self._decisions.get(request_id)
        return None if d is None else (d.replica, d.placement)

    def completed(self, internal_id: str) -> None:
        """Serve finished (or failed) a request: its load leaves the replica, and its
        workflow's children may now follow it."""
        # vLLM publishes a step's KV events before its outputs, so the request's blocks
        # have (all but always) arrived: the index holds them before its in-flight
        # count goes.
        self._apply_kv_events()
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
        """Serve lost replica `replica` (its actor died, or it left the deployment): no
        more decisions for it, its blocks out of the index, its KV subscription closed."""
        self._apply_kv_events()
        if self._kv_feeds is not None:
            self._kv_feeds.close(replica)
        self._offered.discard(replica)
        if replica in self.ctx.state.engines:
            self.ctx.state.set_healthy(self.ctx.state.slot(replica), False)
            self.ctx.index.remove_engine_blocks(replica)

    def kv_index(self) -> dict[str, dict[str, int]]:
        """Per replica, what the prefix index holds and what its KV events said: `blocks`
        in the index; for a subscribed replica also vLLM `events` received, wasma blocks
        `stored` and `removed`, caches `cleared` and blocks left `untranslated` (their
        chain's parent never arrived). For tests and dashboards."""
        self._apply_kv_events()
        index = self.ctx.index
        out = {name: {"blocks": index.blocks_per_engine[i]} for i, name in enumerate(index.engines)}
        counts = self._kv_feeds.counts() if self._kv_feeds is not None else {}
        for name, feed in counts.items():
            out.setdefault(name, {"blocks": 0}).update(feed)
        return out

    def cached_blocks(self, body: Mapping[str, Any], kind: str | None = None) -> dict[str, int]:
        """Per replica, how many of this request's full prompt blocks the prefix index
        says it holds, from the first (what its vLLM would hit)."""
        self._apply_kv_events()
        prompt = self._render(body, kind)
        if prompt is None:
            return {}
        hashes = hash_token_blocks(prompt.token_ids, self.block_size)
        index = self.ctx.index
        return dict(zip(index.engines, index.match(hashes), strict=True))

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


def _node_address() -> str:
    """An address of this process's node that every replica's node reaches: Ray's node
    IP under Ray, the loopback outside it (a state driven in-process)."""
    try:
        import ray
    except ImportError:
        return "127.0.0.1"
    return str(ray.util.get_node_ip_address()) if ray.is_initialized() else "127.0.0.1"


async def render_responses(
    frontend: Frontend, data: dict[str, Any], previous: StoredResponse | None
) -> Prompt | None:
    """As vLLM's `OpenAIServingResponses` renders a request: its `instructions` and
    `input` after the previous response's messages and output, where this state
    saw that response complete (else the new input alone: the replica still has
    the rest). A module function: a coroutine method would make Ray run the state's
    actor on an event loop, where its synchronous renders cannot run."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.renderers.inputs.preprocess import extract_prompt_components

    request = parse_request("responses", data)
    if request.previous_response_id is not None:
        request = request.model_copy(update={"previous_response_id": None})
    known = previous is not None and previous.output is not None
    online = frontend.render.online_renderer
    result = await online.render_responses(
        request,
        previous_messages=previous.messages if known and previous else None,
        previous_response_outputs=previous.output if known and previous else None,
        tool_server=getattr(frontend.render, "tool_server", None),
        skip_mm_cache=True,
    )
    if isinstance(result, ErrorResponse):
        return None
    ids = list(
        extract_prompt_components(frontend.model_config, result.engine_input).token_ids or ()
    )
    if not ids:
        return None
    room = max(1, frontend.max_model_len - len(ids))
    max_tokens = min(request.max_output_tokens or room, room)
    return Prompt(ids, max_tokens, list(result.messages))


__all__ = [
    "PLACED_KINDS",
    "Decision",
    "MetadataError",
    "Prompt",
    "SchedulingState",
    "StoredResponse",
]
