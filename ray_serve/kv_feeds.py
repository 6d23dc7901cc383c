"""The replicas' KV events, as the scheduling state hears them.

Replicas of one Serve deployment share `engine_kwargs`, so one `kv_events_config` would
have every replica's vLLM publisher bind the same port. Ray's `KVAwareRouter` offsets a
base port by the replica's node-local rank (`assign_replica_kv_events_endpoint`) and has
each replica advertise its endpoint in its routing stats. wasma turns it around, as its
in-process engines do: the scheduling state binds one SUB socket per replica on a free
port of its own node (`open`), and the replica, before its engine starts, points its
publisher there (a non-wildcard endpoint makes vLLM connect, not bind). No port can be
taken in between, nothing collides across replicas or nodes, and the state knows which
replica a socket's events are from without asking.

The state's methods run one at a time on its actor's thread, and events matter only when
it decides: it reads what has arrived (`drain`) before each decision, so the index needs
no lock and is current to the last published step. ZMQ queues whatever arrives in
between (a receive high-water mark of 0: a dropped batch would break hash chains).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import zmq

from wasma.core.events import BlockRemoved, BlockStored, KVEvent
from wasma.engines.kv_events import KVEventFeed, bind_subscriber


@dataclass(slots=True)
class _Subscription:
    socket: zmq.Socket[Any]
    endpoint: str
    feed: KVEventFeed
    # wasma's events out of the feed: blocks stored, blocks removed, caches cleared.
    stored: int = 0
    removed: int = 0
    cleared: int = 0

    def tally(self, events: list[KVEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                self.stored += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.removed += len(ev.block_hashes)
            else:
                self.cleared += 1


class ReplicaKVFeeds:
    """One subscription per replica, bound on `host` (an address every replica's node
    reaches: the state's node IP under Ray)."""

    def __init__(self, block_size: int, host: str = "127.0.0.1") -> None:
        self.block_size = block_size
        self.host = host
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._poller = zmq.Poller()
        self._subs: dict[str, _Subscription] = {}

    def __contains__(self, replica: object) -> bool:
        return replica in self._subs

    def open(self, replica: str) -> str:
        """A fresh subscription for `replica` (a replica asking again has a new engine:
        its old feed, and the chain hashes it knew, go); the endpoint its engine's
        publisher connects to."""
        self.close(replica)
        sock: zmq.Socket[Any] = self._ctx.socket(zmq.SUB)
        try:
            endpoint = bind_subscriber(sock, self.host)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._poller.register(sock, zmq.POLLIN)
        self._subs[replica] = _Subscription(sock, endpoint, KVEventFeed(replica, self.block_size))
        return endpoint

    def close(self, replica: str) -> bool:
        """Drop `replica`'s subscription (it died or left); whether it had one."""
        sub = self._subs.pop(replica, None)
        if sub is None:
            return False
        self._poller.unregister(sub.socket)
        sub.socket.close(linger=0)
        return True

    def drain(self) -> list[KVEvent]:
        """Every event that has arrived, translated, replica by replica in arrival order."""
        if not self._subs:
            return []
        out: list[KVEvent] = []
        by_socket = {id(s.socket): s for s in self._subs.values()}
        for sock, _ in self._poller.poll(0):
            sub = by_socket[id(sock)]
            while True:
                try:
                    frames = sub.socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                events = sub.feed.frames(frames)
                sub.tally(events)
                out += events
        return out

    def counts(self) -> dict[str, dict[str, int]]:
        """Per replica, as drained so far: vLLM events received; wasma's blocks stored
        and removed and caches cleared; blocks stored whose chain could not be rebuilt
        (their parent's event never arrived)."""
        return {
            name: {
                "events": sub.feed.events_received,
                "stored": sub.stored,
                "removed": sub.removed,
                "cleared": sub.cleared,
                "untranslated": sub.feed.translator.untranslated,
            }
            for name, sub in self._subs.items()
        }

    def endpoints(self) -> dict[str, str]:
        return {name: sub.endpoint for name, sub in self._subs.items()}

    def close_all(self) -> None:
        for name in list(self._subs):
            self.close(name)
        self._ctx.destroy(linger=0)


__all__ = ["ReplicaKVFeeds"]
