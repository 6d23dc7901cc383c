"""The JSONL trace format: one workflow a line (see DESIGN.md)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from wasma.scheduler.workflow import Workflow, WorkflowError


class TraceError(ValueError):
    """A trace that cannot be read; the message starts with `file:line:`."""


def load_trace(path: str | Path) -> list[Workflow]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text (byte {exc.start}): {exc.reason}") from exc
    workflows: list[Workflow] = []
    seen: dict[str, int] = {}
    # Lines end at "\n" only: str.splitlines() would also split at form feeds and
    # U+2028, which JSON allows inside a string, and misnumber every line after.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from exc
        except (ValueError, RecursionError) as exc:  # duplicate keys; too deep, too long
            raise TraceError(f"{path}:{lineno}: invalid JSON: {_short(exc)}") from exc
        try:
            wf = Workflow.from_dict(data)
        except WorkflowError as exc:
            raise TraceError(f"{path}:{lineno}: {exc}") from exc
        if wf.workflow_id in seen:
            raise TraceError(
                f"{path}:{lineno}: workflow id {wf.workflow_id!r} already used on line "
                f"{seen[wf.workflow_id]}"
            )
        seen[wf.workflow_id] = lineno
        workflows.append(wf)
    if not workflows:
        raise TraceError(f"{path}: trace has no workflows")
    workflows.sort(key=lambda w: w.arrival_s)
    return workflows


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different: with a key twice, json keeps the last
    silently, and a trace would run with a value its author overrode by mistake."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice in one object")
        out[key] = value
    return out


def _short(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc).split(";")[0]


def write_trace(path: str | Path, workflows: Iterable[Workflow]) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for wf in workflows:
                f.write(json.dumps(wf.to_dict(), separators=(",", ":")) + "\n")
    except OSError as exc:
        raise TraceError(f"{path}: cannot write trace: {exc.strerror or exc}") from exc
