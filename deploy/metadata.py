"""Workflow identity of a request, from whichever convention its client speaks.

Agents already tell routers who they are, in several dialects; wasma reads them all so an
agent gets workflow-aware scheduling by changing only the URL. In order of precedence
(the first convention that names a workflow wins; node, parents, app and deadline are
then filled from the same or a lower convention):

1. wasma's headers: `x-wasma-workflow-id`, `-node-id`, `-parents`, `-app`, `-deadline-ms`;
2. the OpenAI body's `metadata`: `wasma_workflow_id`, `wasma_node_id`, ... (same keys);
3. `vllm_xargs.agentic_context` (vLLM router's program scheduling; a JSON string):
   `program_id` | `session_id` → workflow, `task_id` | `agent_id` → node,
   `parent_task_id` | `parent_agent_id` | `parent_task_ids` → parents, `app`,
   `priority`, `deadline` (seconds) | `deadline_ms`;
4. Claude Code: `x-claude-code-session-id` → workflow, `-agent-id` → node,
   `-parent-agent-id` → parent;
5. `session-id`, `thread-id`, `x-session-id` → workflow (node ids are then per request).

Bad values are the client's mistake: `MetadataError` (a 400), never a crash.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from wasma.deploy import json_limits

MAX_ID_LEN = 128
MAX_PARENTS = 256
MAX_CONTEXT_BYTES = 8192
# An hour-long deadline is generous for an agent workflow; a week is a typo.
MAX_DEADLINE_S = 7 * 24 * 3600.0


class MetadataError(ValueError):
    """Workflow metadata the gateway cannot accept; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class WorkflowIdentity:
    """Where a request sits in its workflow; all None for a one-node workflow."""

    workflow_id: str | None = None
    node_id: str | None = None
    parents: tuple[str, ...] = ()
    app: str | None = None
    deadline_s: float | None = None  # relative to the workflow's first request
    priority: int | None = None  # a client's hint (agentic_context); lower runs first
    source: str = "none"  # which convention named the workflow, for logs and tests


def _check_id(value: Any, param: str) -> str:
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise MetadataError(f"{param} must be a string", param)
    text = str(value).strip()
    if not text or len(text) > MAX_ID_LEN:
        raise MetadataError(f"{param} must be 1..{MAX_ID_LEN} characters", param)
    if not text.isprintable():
        raise MetadataError(f"{param} must be printable text", param)
    return text


def _parents(value: Any, param: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items: list[Any]
    if isinstance(value, str):
        items = [p for p in value.split(",") if p.strip()]
    elif isinstance(value, list):
        items = value
    else:
        raise MetadataError(f"{param} must be a comma-separated string or a list", param)
    if len(items) > MAX_PARENTS:
        raise MetadataError(f"{param} lists more than {MAX_PARENTS} parents", param)
    return tuple(dict.fromkeys(_check_id(p, param) for p in items))


def _deadline(value: Any, param: str, scale: float) -> float | None:
    if value is None or value == "":
        return None
    try:
        secs = float(value) * scale
    except (TypeError, ValueError):
        raise MetadataError(f"{param} must be a number", param) from None
    except OverflowError:  # an integer too large for a float
        secs = math.inf
    if isinstance(value, bool) or not math.isfinite(secs) or not 0 < secs <= MAX_DEADLINE_S:
        raise MetadataError(f"{param} must be a positive number (at most a week)", param)
    return secs


def _priority(value: Any, param: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise MetadataError(f"{param} must be an integer", param)
    try:
        prio = int(value)
    except (ValueError, OverflowError):  # "x", NaN; an infinite float
        raise MetadataError(f"{param} must be an integer", param) from None
    if abs(prio) > 1_000_000_000:
        raise MetadataError(f"{param} is out of range", param)
    return prio


@dataclass(slots=True)
class _Partial:
    workflow_id: str | None = None
    node_id: str | None = None
    parents: tuple[str, ...] | None = None
    app: str | None = None
    deadline_s: float | None = None
    priority: int | None = None
    source: str = "none"

    def fill(self, other: _Partial) -> None:
        """Take from `other` whatever this one lacks (`other` has lower precedence)."""
        if self.workflow_id is None:
            self.workflow_id, self.source = other.workflow_id, other.source
        # Node and parents only make sense with the workflow they came with.
        same = self.source == other.source
        if self.node_id is None and (same or other.workflow_id in (None, self.workflow_id)):
            self.node_id = other.node_id
        if self.parents is None and (same or other.workflow_id in (None, self.workflow_id)):
            self.parents = other.parents
        self.app = self.app or other.app
        if self.deadline_s is None:
            self.deadline_s = other.deadline_s
        if self.priority is None:
            self.priority = other.priority


def _from_wasma(get: Mapping[str, Any], prefix: str, where: str) -> _Partial:
    def param(key: str) -> str:
        return f"{where}{prefix}{key}"

    out = _Partial(source=where.rstrip(".") or "headers")
    if (v := get.get(f"{prefix}workflow{_sep(prefix)}id")) is not None:
        out.workflow_id = _check_id(v, param(f"workflow{_sep(prefix)}id"))
    if (v := get.get(f"{prefix}node{_sep(prefix)}id")) is not None:
        out.node_id = _check_id(v, param(f"node{_sep(prefix)}id"))
    if (v := get.get(f"{prefix}parents")) is not None:
        out.parents = _parents(v, param("parents"))
    if (v := get.get(f"{prefix}app")) is not None:
        out.app = _check_id(v, param("app"))
    key = f"deadline{_sep(prefix)}ms"
    out.deadline_s = _deadline(get.get(prefix + key), param(key), 1e-3)
    return out


def _sep(prefix: str) -> str:
    # Headers use dashes (x-wasma-node-id), body metadata underscores (wasma_node_id).
    return "-" if prefix.endswith("-") else "_"


def _from_agentic_context(raw: Any) -> _Partial:
    param = "vllm_xargs.agentic_context"
    if isinstance(raw, str):
        if len(raw) > MAX_CONTEXT_BYTES:
            raise MetadataError(f"{param} is longer than {MAX_CONTEXT_BYTES} bytes", param)
        try:
            ctx = json_limits.loads(raw)
        except ValueError:
            raise MetadataError(f"{param} must be a JSON object (as a string)", param) from None
    else:
        ctx = raw
    if not isinstance(ctx, dict):
        raise MetadataError(f"{param} must be a JSON object", param)
    out = _Partial(source="agentic_context")
    for key in ("program_id", "session_id"):
        if ctx.get(key) is not None:
            out.workflow_id = _check_id(ctx[key], f"{param}.{key}")
            break
    for key in ("task_id", "agent_id"):
        if ctx.get(key) is not None:
            out.node_id = _check_id(ctx[key], f"{param}.{key}")
            break
    for key in ("parent_task_ids", "parent_task_id", "parent_agent_id"):
        if ctx.get(key) is not None:
            out.parents = _parents(ctx[key], f"{param}.{key}")
            break
    if ctx.get("app") is not None:
        out.app = _check_id(ctx["app"], f"{param}.app")
    if ctx.get("deadline_ms") is not None:
        out.deadline_s = _deadline(ctx["deadline_ms"], f"{param}.deadline_ms", 1e-3)
    elif ctx.get("deadline") is not None:
        out.deadline_s = _deadline(ctx["deadline"], f"{param}.deadline", 1.0)
    out.priority = _priority(ctx.get("priority"), f"{param}.priority")
    return out


def _from_frameworks(headers: Mapping[str, str]) -> _Partial:
    out = _Partial()
    if (v := headers.get("x-claude-code-session-id")) is not None:
        out.source = "claude-code"
        out.workflow_id = _check_id(v, "x-claude-code-session-id")
        if (a := headers.get("x-claude-code-agent-id")) is not None:
            out.node_id = _check_id(a, "x-claude-code-agent-id")
        if (p := headers.get("x-claude-code-parent-agent-id")) is not None:
            out.parents = _parents(p, "x-claude-code-parent-agent-id")
        return out
    for name in ("session-id", "thread-id", "x-session-id"):
        if (v := headers.get(name)) is not None:
            out.source = name
            out.workflow_id = _check_id(v, name)
            break
    return out


def workflow_identity(headers: Mapping[str, str], body: Mapping[str, Any]) -> WorkflowIdentity:
    """The request's workflow identity. `headers` must have lower-case names (ASGI's)."""
    merged = _from_wasma(headers, "x-wasma-", "")
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise MetadataError("metadata must be an object of strings", "metadata")
        merged.fill(_from_wasma(metadata, "wasma_", "metadata."))
    xargs = body.get("vllm_xargs")
    if xargs is not None:
        if not isinstance(xargs, dict):
            raise MetadataError("vllm_xargs must be an object", "vllm_xargs")
        if xargs.get("agentic_context") is not None:
            merged.fill(_from_agentic_context(xargs["agentic_context"]))
    merged.fill(_from_frameworks(headers))
    if merged.workflow_id is None and (merged.node_id is not None or merged.parents):
        raise MetadataError(
            "a node id or parents need a workflow id (x-wasma-workflow-id)",
            "x-wasma-workflow-id",
        )
    if merged.node_id is not None and merged.parents and merged.node_id in merged.parents:
        raise MetadataError(f"node {merged.node_id!r} lists itself as a parent", "x-wasma-parents")
    return WorkflowIdentity(
        workflow_id=merged.workflow_id,
        node_id=merged.node_id,
        parents=merged.parents or (),
        app=merged.app,
        deadline_s=merged.deadline_s,
        priority=merged.priority,
        source=merged.source if merged.workflow_id is not None else "none",
    )
