"""Production trace formats in and out of the project's trace format.

Mooncake (FAST'25, also aiperf's `mooncake_trace` input): JSONL, one request a line,
`timestamp` (ms), `input_length`, `output_length`, `hash_ids`: one id per 512-token block
of the prompt (the last one may be partial), where equal ids mean equal content *and*
equal prefix (the ids are prefix hashes). Each id becomes the shared segment
`mooncake:<id>` of that block's length, so two prompts share exactly the blocks the trace
says they share, and the simulator's and engines' block-hash chains follow.

Azure LLM inference traces: CSV `TIMESTAMP,ContextTokens,GeneratedTokens`; they carry no
content, so each prompt is unique.

Each request becomes a one-node workflow whose deadline is `slack` x its latency alone on
an idle engine of `profile` (the apps' rule), since the traces carry none. With
`sessions`, Mooncake requests that continue an earlier request's whole context (the next
turn of a conversation) become that request's children, and a conversation one workflow
(`session_parents` says which request continues which; docs/kv-tier.md).

Export writes Mooncake lines: the prompt's 512-token blocks are chained as the simulator
chains its blocks (a block's id names its content and everything before it) and numbered
in order of first appearance, which is how the published traces number them; a trace
imported from Mooncake exports back to the same lines.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from wasma.core.profile import Profile
from wasma.core.tokens import BlockHasher, Piece, Span
from wasma.scheduler.trace import TraceError
from wasma.scheduler.workflow import ContextOf, Node, Segment, Shared, Unique, Workflow

MOONCAKE_BLOCK_TOKENS = 512
FORMATS = ("mooncake", "azure")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a production trace."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # Mooncake block ids (empty: unique content)
    session_id: str | None = None


def _read_text(path: Path) -> str:
    """The file's text; `.gz` files are decompressed (published traces ship that way)."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return f.read()
        return path.read_text()
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:  # before OSError: a subclass
        raise TraceError(f"{path}: not a readable gzip file: {exc}") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text (byte {exc.start}): {exc.reason}") from None


def _count(value: Any, where: str, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def read_mooncake(path: str | Path) -> list[TraceRequest]:
    path = Path(path)
    out: list[TraceRequest] = []
    for lineno, line in enumerate(_read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise TraceError(f"{where}: invalid JSON: {str(exc).split(';')[0]}") from None
        if not isinstance(rec, dict):
            raise TraceError(f"{where}: a Mooncake record must be a JSON object")
        for key in ("timestamp", "input_length", "output_length"):
            if key not in rec:
                raise TraceError(f"{where}: missing field {key!r}")
        ts = rec["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
            raise TraceError(f"{where}: timestamp must be a number of milliseconds, got {ts!r}")
        if ts < 0:
            raise TraceError(f"{where}: timestamp must be >= 0, got {ts!r}")
        n_in = _count(rec["input_length"], where, "input_length", 1)
        n_out = _count(rec["output_length"], where, "output_length", 1)
        ids = rec.get("hash_ids", [])
        if not isinstance(ids, list):
            raise TraceError(f"{where}: hash_ids must be a list of integers")
        for h in ids:
            _count(h, where, "each hash id", 0)
        if ids and len(ids) != -(-n_in // MOONCAKE_BLOCK_TOKENS):
            raise TraceError(
                f"{where}: {len(ids)} hash_ids for input_length {n_in} (expected "
                f"{-(-n_in // MOONCAKE_BLOCK_TOKENS)}, one a {MOONCAKE_BLOCK_TOKENS}-token block)"
            )
        session = rec.get("session_id")
        out.append(
            TraceRequest(
                ts / 1000.0, n_in, n_out, tuple(ids), None if session is None else str(session)
            )
        )
    if not out:
        raise TraceError(f"{path}: trace has no requests")
    return out


def _azure_time(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        # Azure's CSVs write timestamps like "2023-11-16 18:15:46.6805900": 7 fractional
        # digits, one more than datetime reads.
        head, _, frac = value.strip().partition(".")
        stamp = datetime.fromisoformat(head + ("." + frac[:6] if frac else ""))
        return stamp.timestamp()


def read_azure(path: str | Path) -> list[TraceRequest]:
    path = Path(path)
    rows = list(csv.reader(_read_text(path).splitlines()))
    if not rows:
        raise TraceError(f"{path}: trace has no requests")
    header = [h.strip() for h in rows[0]]
    want = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    if any(w not in header for w in want):
        raise TraceError(f"{path}:1: header must name {', '.join(want)}, got {header}")
    col = [header.index(w) for w in want]
    times: list[float] = []
    raw: list[tuple[int, int]] = []
    for lineno, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        where = f"{path}:{lineno}"
        if len(row) < len(header):
            raise TraceError(f"{where}: {len(row)} fields, header has {len(header)}")
        try:
            t = _azure_time(row[col[0]])
            n_in, n_out = int(row[col[1]]), int(row[col[2]])
        except ValueError as exc:
            raise TraceError(f"{where}: {exc}") from None
        if not math.isfinite(t):
            raise TraceError(f"{where}: TIMESTAMP must be finite")
        _count(n_in, where, "ContextTokens", 1)
        _count(n_out, where, "GeneratedTokens", 1)
        times.append(t)
        raw.append((n_in, n_out))
    if not raw:
        raise TraceError(f"{path}: trace has no requests")
    t0 = min(times)
    return [TraceRequest(t - t0, a, b) for t, (a, b) in zip(times, raw, strict=True)]


def read_requests(fmt: str, path: str | Path) -> list[TraceRequest]:
    if fmt == "mooncake":
        return read_mooncake(path)
    if fmt == "azure":
        return read_azure(path)
    raise TraceError(f"unknown trace format {fmt!r}; choose from: {', '.join(FORMATS)}")


# Fewer shared blocks than this are no evidence of a conversation: every prompt of
# Mooncake's conversation trace starts with the same block (the service's system prompt).
SESSION_MIN_BLOCKS = 2


def _full_ids(r: TraceRequest) -> tuple[int, ...]:
    """The ids of the request's full 512-token blocks: a partial last block's id names
    that block alone, so a longer prompt has another id there."""
    return r.hash_ids if r.input_tokens % MOONCAKE_BLOCK_TOKENS == 0 else r.hash_ids[:-1]


def session_parents(
    requests: Sequence[TraceRequest], min_blocks: int = SESSION_MIN_BLOCKS
) -> list[int | None]:
    """For each request, the index of the earlier request it continues (None: none).

    Request C continues P when P came first (earlier timestamp, or the same and earlier
    in the file), C's hash ids start with all of P's full-block ids (at least
    `min_blocks` of them) and C's prompt is longer than P's whole context, its prompt
    and its output (the next turn holds the answer it follows; Mooncake's ids cover
    prompts only, so this is checked by length). Of several such P, the one sharing the
    most blocks, then the longest prompt, then the latest."""
    by_full: dict[tuple[int, ...], list[int]] = {}
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    parent: list[int | None] = [None] * len(requests)
    for i in order:
        c = requests[i]
        ids = c.hash_ids
        for k in range(len(ids), min_blocks - 1, -1):
            fits = [
                j
                for j in by_full.get(ids[:k], ())
                if requests[j].input_tokens + requests[j].output_tokens < c.input_tokens
            ]
            if fits:
                parent[i] = max(fits, key=lambda j: (requests[j].input_tokens, j))
                break
        full = _full_ids(c)
        if len(full) >= min_blocks:
            by_full.setdefault(full, []).append(i)
    return parent


def _blocks(r: TraceRequest, start: int = 0) -> list[Shared | Unique]:
    """The request's prompt from token `start` on, one shared segment per block (or the
    part of it from `start`)."""
    if not r.hash_ids:
        return [Unique(r.input_tokens - start)]
    out: list[Shared | Unique] = []
    for b, h in enumerate(r.hash_ids):
        lo = max(b * MOONCAKE_BLOCK_TOKENS, start)
        hi = min((b + 1) * MOONCAKE_BLOCK_TOKENS, r.input_tokens)
        if hi > lo:
            out.append(Shared(f"mooncake:{h}", hi - lo))
    return out


def to_workflows(
    requests: Sequence[TraceRequest],
    profile: Profile,
    slack: float = 2.0,
    app: str = "mooncake",
    sessions: bool = False,
) -> tuple[list[Workflow], int]:
    """(the workflows, how many requests were dropped for exceeding the profile's
    `max_model_len`). One workflow a request; with `sessions`, one a conversation."""
    if not slack > 0:
        raise ValueError("--slack must be positive")
    t0 = min(r.arrival_s for r in requests)
    # Numbered by position in the file, dropped requests included.
    index = [
        i
        for i, r in enumerate(requests)
        if r.input_tokens + r.output_tokens <= profile.max_model_len
    ]
    kept = [requests[i] for i in index]
    dropped = len(requests) - len(kept)

    def deadline(r: TraceRequest) -> float:
        alone = profile.request_alone_s(r.input_tokens, r.output_tokens)
        return max(round(slack * alone, 6), 0.001)

    if not sessions:
        out: list[Workflow] = []
        for n, r in enumerate(kept):
            i = index[n]
            node = Node("r", (), r.output_tokens, tuple(_blocks(r)))
            arrival = round(r.arrival_s - t0, 6)
            out.append(Workflow.create(f"{app}-{i}", app, arrival, deadline(r), [node]))
        return out, dropped
    parent = session_parents(kept)
    root = list(range(len(kept)))
    members: dict[int, list[int]] = {}
    for n in sorted(range(len(kept)), key=lambda n: kept[n].arrival_s):
        p = parent[n]
        root[n] = n if p is None else root[p]
        members.setdefault(root[n], []).append(n)
    wfs: list[Workflow] = []
    for top, group in members.items():
        name = f"{app}-{index[top]}"
        arrival = round(kept[top].arrival_s - t0, 6)
        nodes: list[Node] = []
        end = 0.0
        for n in group:
            r = kept[n]
            nid = f"r{index[n]}"
            p = parent[n]
            if p is None:
                prompt: list[Segment] = list(_blocks(r))
                parents: tuple[str, ...] = ()
            else:
                # The parent's whole context (prompt and output: the answer this turn
                # follows), then the rest of this prompt's blocks.
                q = kept[p]
                pid = f"r{index[p]}"
                prompt = [ContextOf(pid), *_blocks(r, q.input_tokens + q.output_tokens)]
                parents = (pid,)
            at = round(r.arrival_s - t0, 6)
            nodes.append(Node(nid, parents, r.output_tokens, tuple(prompt), at, deadline(r)))
            end = max(end, at - arrival + deadline(r))
        wfs.append(Workflow.create(name, app, arrival, round(end, 6), nodes))
    wfs.sort(key=lambda w: w.arrival_s)
    return wfs, dropped


def _tail(span: Span, skip: int) -> tuple[Piece, ...]:
    """The pieces of `span` after its first `skip` tokens."""
    out: list[Piece] = []
    for p in span:
        if skip >= p.length:
            skip -= p.length
            continue
        out.append(Piece(p.stream, p.start + skip, p.length - skip) if skip else p)
        skip = 0
    return tuple(out)


def to_mooncake(workflows: Iterable[Workflow]) -> list[dict[str, Any]]:
    """Mooncake records for every node, in arrival then DAG order. A node's timestamp is
    its own arrival where it has one (a conversation's turn), else its workflow's (a
    child's real start depends on its parents); nodes of a workflow with several share
    its `session_id`, which aiperf replays in order."""
    hasher = BlockHasher(MOONCAKE_BLOCK_TOKENS)
    ids: dict[Any, int] = {}
    out: list[dict[str, Any]] = []
    todo: list[tuple[float, int, Workflow, str]] = []
    for wf in sorted(workflows, key=lambda w: w.arrival_s):
        for node in wf.topo_order():
            at = wf.nodes[node].arrival_s
            todo.append((wf.arrival_s if at is None else at, len(todo), wf, node))
    todo.sort(key=lambda t: (t[0], t[1]))
    for at, _seq, wf, node in todo:
        span = wf.prompt_span(node)
        tokens = wf.prompt_tokens(node)
        chain: list[Any] = list(hasher.chain(span))
        if tokens % MOONCAKE_BLOCK_TOKENS:
            # A partial last block is named by its prefix and its own content.
            parent = chain[-1] if chain else None
            chain.append((parent, _tail(span, len(chain) * MOONCAKE_BLOCK_TOKENS)))
        rec: dict[str, Any] = {
            "timestamp": round(at * 1000),
            "input_length": tokens,
            "output_length": wf.nodes[node].output_tokens,
            "hash_ids": [ids.setdefault(h, len(ids)) for h in chain],
        }
        if len(wf.nodes) > 1:
            rec["session_id"] = wf.workflow_id
        out.append(rec)
    return out


def write_mooncake(path: str | Path, records: Iterable[dict[str, Any]]) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    except OSError as exc:
        raise TraceError(f"{path}: cannot write trace: {exc.strerror or exc}") from None
