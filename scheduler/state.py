"""Per-engine load as the router sees it: its own counters plus what engines report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from wasma.core.events import EngineStats


@dataclass(slots=True)
class EngineLoad:
    """One engine's load. Router-side fields move on dispatch/finish; the `reported_*`
    fields are the engine's last stats (scraped or event-fed) and may lag."""

    name: str
    # The machine whose CPU cores this engine's compute shares with the other engines
    # naming the same host ("" = a device of its own, e.g. a GPU): see
    # `Profile.host_contention`.
    host: str = ""
    outstanding: int = 0  # requests dispatched and not finished
    active_blocks: int = 0  # KV blocks the outstanding requests will hold (prompt + output)
    pending_prefill_tokens: int = 0  # prompt tokens still to prefill (not cached)
    pending_decode_tokens: int = 0  # output tokens still to generate
    healthy: bool = True
    reported_running: int = 0
    reported_waiting: int = 0
    reported_kv_usage: float = 0.0
    num_kv_blocks: int = 0
    dispatched_total: int = 0


@dataclass(frozen=True, slots=True)
class Charge:
    """What one request adds to an engine's load until it finishes."""

    blocks: int
    prefill_tokens: int
    decode_tokens: int


class ClusterState:
    def __init__(
        self,
        engines: Sequence[str],
        num_kv_blocks: int = 0,
        hosts: Sequence[str] | None = None,
    ) -> None:
        if hosts is not None and len(hosts) != len(engines):
            raise ValueError(f"{len(hosts)} hosts for {len(engines)} engines")
        self.loads = [
            EngineLoad(name, host=hosts[i] if hosts else "", num_kv_blocks=num_kv_blocks)
            for i, name in enumerate(engines)
        ]
        self._slot = {name: i for i, name in enumerate(engines)}
        # request id -> [slot, blocks, prefill tokens, decode tokens]: its `Charge`, as a
        # list the first token updates in place (two of them a request otherwise)
        self._charges: dict[str, list[int]] = {}
        self._neighbours: list[list[int]] | None = None
        self._healthy: list[int] | None = None  # healthy slots, until health changes

    @property
    def engines(self) -> list[str]:
        return [load.name for load in self.loads]

    def slot(self, engine: str) -> int:
        return self._slot[engine]

    def add_engine(self, name: str, num_kv_blocks: int = 0, host: str = "") -> int:
        if name in self._slot:
            return self._slot[name]
        self._slot[name] = len(self.loads)
        self.loads.append(EngineLoad(name, host=host, num_kv_blocks=num_kv_blocks))
        self._neighbours = None
        self._healthy = None
        return self._slot[name]

    def host_neighbours(self) -> list[list[int]]:
        """For each engine, the other engines sharing its host's cores (empty for an
        engine with a device of its own)."""
        if self._neighbours is not None:
            return self._neighbours
        by_host: dict[str, list[int]] = {}
        for i, load in enumerate(self.loads):
            if load.host:
                by_host.setdefault(load.host, []).append(i)
        self._neighbours = [
            [j for j in by_host[load.host] if j != i] if load.host else []
            for i, load in enumerate(self.loads)
        ]
        return self._neighbours

    def on_dispatch(self, request_id: str, slot: int, charge: Charge) -> None:
        self.dispatched(
            request_id, slot, charge.blocks, charge.prefill_tokens, charge.decode_tokens
        )

    def dispatched(
        self, request_id: str, slot: int, blocks: int, prefill_tokens: int, decode_tokens: int
    ) -> None:
        """`on_dispatch` of `Charge(blocks, prefill_tokens, decode_tokens)`, not built."""
        load = self.loads[slot]
        load.outstanding += 1
        load.dispatched_total += 1
        load.active_blocks += blocks
        load.pending_prefill_tokens += prefill_tokens
        load.pending_decode_tokens += decode_tokens
        self._charges[request_id] = [slot, blocks, prefill_tokens, decode_tokens]

    def on_first_token(self, request_id: str) -> None:
        entry = self._charges.get(request_id)
        if entry is None:
            return
        if entry[2]:
            self.loads[entry[0]].pending_prefill_tokens -= entry[2]
            entry[2] = 0

    def on_finish(self, request_id: str) -> None:
        entry = self._charges.pop(request_id, None)
        if entry is None:
            return
        slot, blocks, prefill_tokens, decode_tokens = entry
        load = self.loads[slot]
        load.outstanding -= 1
        load.active_blocks -= blocks
        load.pending_prefill_tokens -= prefill_tokens
        load.pending_decode_tokens -= decode_tokens

    def on_stats(self, slot: int, stats: EngineStats) -> None:
        self.on_load(
            slot, stats.num_running, stats.num_waiting, stats.kv_usage, stats.num_kv_blocks
        )

    def on_load(
        self, slot: int, running: int, waiting: int, kv_usage: float, num_kv_blocks: int
    ) -> None:
        """The part of an engine's stats the load reads (`on_stats` without the report
        built: the simulator reports after every engine step)."""
        load = self.loads[slot]
        load.reported_running = running
        load.reported_waiting = waiting
        load.reported_kv_usage = kv_usage
        load.num_kv_blocks = num_kv_blocks

    def set_healthy(self, slot: int, healthy: bool) -> None:
        self.loads[slot].healthy = healthy
        self._healthy = None

    def healthy_slots(self) -> list[int]:
        """The slots of the healthy engines, in order (a new list each call). Kept
        between calls, as health changes only through `set_healthy`: a decision on a
        1,024-engine cluster then does not walk every engine for it."""
        if self._healthy is None:
            self._healthy = [i for i, load in enumerate(self.loads) if load.healthy]
        return list(self._healthy)

    def engine_of(self, request_id: str) -> int | None:
        entry = self._charges.get(request_id)
        return entry[0] if entry else None
