"""Prefix KV copies on engines' outbound links: when each one lands.

Every copy of a prefix off an engine goes out over that engine's link, so copies from
one engine queue behind each other (first come, first served). The router books each
transfer it orders here, so the next placement is priced with the link as it will be;
the simulator books the same copies on its own schedule, as the truth of when they land.

Where engines can relay what they receive (GPUs running the planner's pipelined chains
and trees), copies of one prefix from one engine go as one broadcast: a destination
that joins the group while it is still in flight lands when the grown group does (a
pipelined chain: the slowest hop's rate plus a hop's start-up per destination), instead
of a whole copy behind the first.
The live vLLM connector pulls each copy from the holder itself and cannot relay, so
there every copy queues.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from wasma.scheduler.pricing import TransferPricer


@dataclass(frozen=True, slots=True)
class Booking:
    ready_s: float  # when the prefix is on the destination (absolute)
    joined: bool  # rides a broadcast of the same prefix already in flight


@dataclass(slots=True)
class _Group:
    """The copy last booked on one engine's link, with the destinations it feeds."""

    chain: Sequence[int]  # block hashes; the first `num_blocks` are moved
    num_blocks: int
    num_bytes: int
    start_s: float
    end_s: float
    dsts: list[str]


class CopySchedule:
    """Engines are named as the pricer knows them; one that was never booked has an idle
    link, so engines added later need nothing."""

    def __init__(self, pricer: TransferPricer, relay: bool) -> None:
        self.pricer = pricer
        self.relay = relay
        self._free_s: dict[str, float] = {}  # when each engine's link has sent all it was given
        self._last: dict[str, _Group] = {}
        self.booked = 0  # copies booked
        self.joined = 0  # ... of which rode a broadcast in flight
        self.queued = 0  # ... of which waited for the link

    def free_s(self, src: str) -> float:
        """When engine `src`'s outbound link is done with the copies booked on it."""
        return self._free_s.get(src, 0.0)

    def joinable(self, src: str, chain: Sequence[int], num_blocks: int, now: float) -> bool:
        """Whether a copy of `chain[:num_blocks]` from `src` can ride a broadcast in flight."""
        g = self._last.get(src)
        return (
            self.relay
            and g is not None
            and now < g.end_s
            and g.num_blocks >= num_blocks > 0
            and g.chain[num_blocks - 1] == chain[num_blocks - 1]
        )

    def quote(
        self,
        src: str,
        dst: str,
        chain: Sequence[int],
        num_blocks: int,
        num_bytes: int,
        now: float,
        broadcast: bool = True,
    ) -> Booking:
        """When `chain[:num_blocks]` (`num_bytes` of it missing at `dst`) would be on `dst`
        if booked now: behind the copies already on `src`'s link, or with the broadcast
        of that prefix in flight from `src` where that lands sooner. Books nothing."""
        booking, _ = self._plan(src, dst, chain, num_blocks, num_bytes, now, broadcast)
        return booking

    def book(
        self,
        src: str,
        dst: str,
        chain: Sequence[int],
        num_blocks: int,
        num_bytes: int,
        now: float,
        broadcast: bool = True,
    ) -> Booking:
        """Book the copy `quote` prices; returns when it lands."""
        booking, end = self._plan(src, dst, chain, num_blocks, num_bytes, now, broadcast)
        self.booked += 1
        self.joined += booking.joined
        self.queued += not booking.joined and self.free_s(src) > now
        g = self._last.get(src)
        if booking.joined:
            assert g is not None
            if dst not in g.dsts:
                g.dsts.append(dst)
            g.num_bytes = max(g.num_bytes, num_bytes)
            g.end_s = end
        else:
            start = max(now, self.free_s(src))
            self._last[src] = _Group(chain, num_blocks, num_bytes, start, end, [dst])
        self._free_s[src] = max(self.free_s(src), end)
        return booking

    def _plan(
        self,
        src: str,
        dst: str,
        chain: Sequence[int],
        num_blocks: int,
        num_bytes: int,
        now: float,
        broadcast: bool,
    ) -> tuple[Booking, float]:
        """(the booking, the end of the group it would be in)."""
        start = max(now, self.free_s(src))
        alone = start + self.pricer.estimate_s(src, [dst], num_bytes)
        if broadcast and self.joinable(src, chain, num_blocks, now):
            g = self._last[src]
            if dst in g.dsts:
                return Booking(g.end_s, True), g.end_s
            # The group is the last copy on the link, so growing it delays nothing booked
            # after it; its earlier destinations keep their times (a chain's new tail
            # does not slow the hops before it). A pipelined chain moves at its slowest
            # hop's rate plus one hop's start-up a destination: the new tail lands one
            # start-up after the later of the group's end and its own copy's time from
            # the group's start. (Pricing the grown set with the planner would plan every
            # new destination set afresh, milliseconds each, inside a placement.)
            size = max(g.num_bytes, num_bytes)
            own = self.pricer.estimate_s(src, [dst], size)
            end = max(g.end_s, g.start_s + own) + self.pricer.estimate_s(src, [dst], 1)
            if end <= alone:
                return Booking(end, True), end
        return Booking(alone, False), alone
