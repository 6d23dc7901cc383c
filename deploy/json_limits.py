"""JSON from clients, decoded with a bound on nesting.

msgspec (like `json`) decodes nested arrays and objects by recursion: a body of 100,000
`[` raises `RecursionError`, which is no client error a handler expects (it was a 500).
Every body the gateway parses goes through here, so nesting past `MAX_JSON_DEPTH` is a
`JsonTooDeep` (a 400), whether msgspec's recursion gives out first or the value decoded
into an untyped field (`Any`) is deeper than the limit.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

# Far above what an API body needs (a tool's JSON schema nests ~10 deep), far below
# the interpreter's recursion limit, which code that walks a decoded value would hit.
MAX_JSON_DEPTH = 64


class JsonTooDeep(ValueError):
    """A JSON value nested deeper than the limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"JSON nested deeper than {limit} levels")
        self.limit = limit


def depth_exceeds(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `value` (decoded JSON: dicts, lists, scalars) nests deeper than `limit`.
    Iterative, and linear in the value's size: it stops at the first level too deep."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def check_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> None:
    if depth_exceeds(value, limit):
        raise JsonTooDeep(limit)


def decode(body: bytes | str, type: Any = Any, limit: int = MAX_JSON_DEPTH) -> Any:
    """`msgspec.json.decode(body, type=type)`, with nesting past `limit` a `JsonTooDeep`.
    A typed decode bounds nesting by its type except where that type is `Any`: callers
    check those fields with `check_depth` (an untyped decode is checked here)."""
    try:
        value = msgspec.json.decode(body, type=type)
    except RecursionError:
        raise JsonTooDeep(limit) from None
    if type is Any:
        check_depth(value, limit)
    return value


def loads(text: str, limit: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads(text)` under the same bound (for JSON carried inside a string)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JsonTooDeep(limit) from None
    check_depth(value, limit)
    return value
