"""A durable record of registered workflows, so a restarted router keeps their DAGs and
progress.

Append-only JSON lines, one per event (`register`, `finish`, `close`), flushed on every
write: a router actor that Ray restarts replays the file on start and carries on from
the nodes that had finished. Requests that were *in flight* when the router died are not
recovered from here; their clients get a retryable 503 (the gateway's channel fails them
with `Retry-After`) and resend, and the replayed DAG takes them as the next run of those
nodes. The file is compacted on open (closed workflows dropped), so it holds only what
is live.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)


class WorkflowJournal:
    """Register/finish/close records of registered DAGs, keyed by tenant-scoped id."""

    def __init__(self, path: str | Path, fsync: bool = False) -> None:
        self.path = Path(path)
        self.fsync = fsync  # flush alone survives a process crash; fsync a machine crash
        self._fh: IO[str] | None = None

    # -- writing ---------------------------------------------------------------------
    def _write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("a", encoding="utf-8")
        self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._fh.flush()
        if self.fsync:
            os.fsync(self._fh.fileno())

    def register(self, key: str, dag: dict[str, Any], deadline_left_s: float) -> None:
        self._write({"op": "register", "key": key, "dag": dag, "wall": time.time(),
                     "deadline_left_s": deadline_left_s})  # fmt: skip

    def finish(self, key: str, node_id: str, engine: int) -> None:
        self._write({"op": "finish", "key": key, "node": node_id, "engine": engine})

    def close_workflow(self, key: str) -> None:
        self._write({"op": "close", "key": key})

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    # -- reading ---------------------------------------------------------------------
    def _records(self) -> Iterator[dict[str, Any]]:
        if not self.path.exists():
            return
        with self.path.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                try:
                    rec = json.loads(line)
                except ValueError:
                    # A torn last line from a crash mid-write: everything before it holds.
                    log.warning("journal %s: skipping unreadable line %d", self.path, n)
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("key"), str):
                    yield rec

    def live(self) -> dict[str, dict[str, Any]]:
        """Workflows registered and not closed: key -> {"register": rec, "finished":
        {node: engine}}; compacts the file to exactly these."""
        out: dict[str, dict[str, Any]] = {}
        for rec in self._records():
            key, op = rec["key"], rec.get("op")
            if op == "register":
                out[key] = {"register": rec, "finished": {}}
            elif op == "finish" and key in out:
                out[key]["finished"][str(rec.get("node"))] = int(rec.get("engine") or 0)
            elif op == "close":
                out.pop(key, None)
        self._compact(out)
        return out

    def _compact(self, live: dict[str, dict[str, Any]]) -> None:
        self.close()
        if not self.path.exists():
            return
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        with tmp.open("w", encoding="utf-8") as fh:
            for key, entry in live.items():
                fh.write(json.dumps(entry["register"], separators=(",", ":")) + "\n")
                for node, engine in entry["finished"].items():
                    rec = {"op": "finish", "key": key, "node": node, "engine": engine}
                    fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
        os.replace(tmp, self.path)  # atomic: a crash leaves the old file or the new one
