"""Gather and scatter at the bandwidth bound: distinct bytes, one flow.

A scatter sends each destination its own part of one source's bytes; a gather brings
parts held by several devices to one destination (a part may be held by several, any
of which may send it). No byte is wanted twice, so nothing is duplicated and the move is
a single-commodity flow with demands: a super-source (the source, or one node per part
feeding its holders) and a super-sink (each destination, or the one destination), the
edge of part j carrying `lam * bytes_j`. The largest `lam` every part's edge saturates at
is `lam*`, and `1 / lam*` seconds is the least time any schedule takes to push the bytes
through the fabric: a cut of capacity C separating parts of demand B needs B / C.

`lam*` is the smallest C / B over cuts (with B the demand a cut leaves unserved), found by
Newton's iteration on the parametric min cut (each step's cut gives the next `lam`, which
falls to `lam*` in a few max flows). The flow at `lam*`, decomposed into paths, is the
schedule: each path carries its flow times `1 / lam*` bytes, cut into hops at every GPU
it passes (GPUs store and forward; switches, NICs and CPUs route).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import networkx as nx
from networkx.algorithms.flow import edmonds_karp

from wasma.transfer.packing import FlowNetwork
from wasma.transfer.plan import Hop, Span

# Newton steps on the parametric cut before giving up on exactness (each is a max flow;
# the iteration is exact in finitely many, and 2-4 suffice on the presets).
MAX_NEWTON_STEPS = 32


@dataclass(frozen=True)
class Demand:
    """`num_bytes` starting at `offset_bytes`, wanted at `dst`, sendable by any `senders`."""

    senders: tuple[str, ...]
    dst: str
    offset_bytes: int
    num_bytes: int


@dataclass(frozen=True)
class FlowSchedule:
    """Paths (devices, sender first) with their rates, per group of parts (see
    `DemandFlow`); `lam` is `lam*` of the flow they came from."""

    lam: float
    paths: tuple[tuple[int, tuple[str, ...], float], ...]  # (group index, devices, B/s)

    @property
    def seconds(self) -> float:
        """The fluid time: every demand's bytes through the fabric at once."""
        return 1.0 / self.lam if self.lam > 0 else math.inf


def scatter_demands(src: str, wanted: Sequence[Span]) -> list[Demand]:
    return [Demand((src,), s.device, s.offset_bytes, s.num_bytes) for s in wanted if s.num_bytes]


def gather_demands(held: Sequence[Span], dst: str, num_bytes: int) -> list[Demand]:
    """The parts `dst` lacks, each with the devices that hold all of it: the bytes are cut
    at every held span's edges, and a piece goes to whoever holds it."""
    own = [(s.offset_bytes, s.end) for s in held if s.device == dst]
    edges = sorted({0, num_bytes, *(e for s in held for e in (s.offset_bytes, s.end))})
    demands: list[Demand] = []
    for lo, hi in itertools.pairwise(edges):
        if hi <= lo or any(a <= lo and hi <= b for a, b in own):
            continue
        senders = tuple(
            dict.fromkeys(
                s.device for s in held if s.offset_bytes <= lo and hi <= s.end and s.device != dst
            )
        )
        previous = demands[-1] if demands else None
        if (
            previous
            and previous.senders == senders
            and previous.offset_bytes + previous.num_bytes == lo
        ):
            demands[-1] = Demand(senders, dst, previous.offset_bytes, hi - previous.offset_bytes)
        else:
            demands.append(Demand(senders, dst, lo, hi - lo))
    return demands


class DemandFlow:
    """The flow graph of a `FlowNetwork` with one demand edge per group of parts: a
    gather's parts (one destination) on the source side, a scatter's destinations (one
    sender) on the sink side. Parts of one group are interchangeable bytes, so a path may
    carry any of them; a mix of both (several senders to several destinations, distinct
    bytes) would be a multi-commodity flow, and is refused."""

    def __init__(
        self,
        network: FlowNetwork,
        demands: Sequence[Demand],
        weights: Sequence[float] | None = None,
    ) -> None:
        self.network = network
        self.demands = tuple(d for d in demands if d.num_bytes > 0)
        dsts = {d.dst for d in self.demands}
        senders = {d.senders for d in self.demands}
        self.gather = len(dsts) <= 1
        if not self.gather and len(senders) > 1:
            raise ValueError("parts from several senders to several destinations")
        groups: dict[object, list[Demand]] = {}
        for d in self.demands:
            groups.setdefault(d if self.gather else d.dst, []).append(d)
        self.groups = tuple(tuple(g) for g in groups.values())
        # Per group, how much more rate than its share of bytes it asks for: a group whose
        # paths are deep (more pipeline fill) may take more of a shared bottleneck and
        # finish with the rest (`Planner` sets these; 1 is the plain bound's flow).
        self.weights = tuple(weights) if weights is not None else (1.0,) * len(self.groups)
        if len(self.weights) != len(self.groups) or not all(w > 0 for w in self.weights):
            raise ValueError("one positive weight per group")
        self.graph = network.split_graph()
        self._in, self._out = network.inlet, network.outlet

    def _bytes(self, g: int) -> float:
        return self.weights[g] * float(sum(d.num_bytes for d in self.groups[g]))

    def _with_demands(self, lam: float) -> nx.DiGraph:
        graph = self.graph.copy()
        for g, group in enumerate(self.groups):
            head = group[0]
            if self.gather:
                graph.add_edge("*", ("part", g), capacity=lam * self._bytes(g))
                for sender in head.senders:
                    graph.add_edge(("part", g), self._out(sender))  # unbounded
                graph.add_edge(self._in(head.dst), "#")
            else:
                for sender in head.senders:
                    graph.add_edge("*", self._out(sender))
                graph.add_edge(self._in(head.dst), ("part", g))
                graph.add_edge(("part", g), "#", capacity=lam * self._bytes(g))
        return graph

    def alone_Bps(self, g: int) -> float:
        """The max flow of group g's parts with nothing else moving."""
        head = self.groups[g][0]
        graph = self.graph.copy()
        for sender in head.senders:
            graph.add_edge("*", self._out(sender))
        if self._in(head.dst) not in graph:
            return 0.0
        return float(nx.maximum_flow_value(graph, "*", self._in(head.dst)))

    def lam_star(self) -> float:
        """The largest `lam` at which every group's demand edge is saturated (0: some
        part cannot reach its destination at all; inf: nothing to move)."""
        if not self.groups:
            return math.inf
        total = float(sum(self._bytes(g) for g in range(len(self.groups))))
        # Start above lam*: no group moves faster than it would alone.
        lam = min(self.alone_Bps(g) / self._bytes(g) for g in range(len(self.groups)))
        if not lam > 0:
            return 0.0
        for _ in range(MAX_NEWTON_STEPS):
            value, (side, _) = nx.minimum_cut(self._with_demands(lam), "*", "#")
            if value >= lam * total * (1 - 1e-12):
                return lam
            # The cut is fabric capacity C plus lam times the demand edges it crosses;
            # the demand B it leaves on the far side can get at most C, so lam <= C / B.
            crossed = sum(
                self._bytes(g)
                for g in range(len(self.groups))
                if (("part", g) not in side) == self.gather
            )
            left = total - crossed
            if left <= 0:
                return lam
            lam = max(0.0, (value - lam * crossed) / left)
        return lam

    def schedule(self) -> FlowSchedule | None:
        """The flow at `lam*` as paths, or None when some part cannot be delivered."""
        lam = self.lam_star()
        if not lam > 0:
            return None
        if math.isinf(lam):
            return FlowSchedule(lam, ())
        # Edmonds-Karp augments along shortest paths first, so the flow it leaves is
        # made of few-hop paths (less pipeline fill) and is the same on every run.
        _, flow = nx.maximum_flow(self._with_demands(lam), "*", "#", flow_func=edmonds_karp)
        residual: dict[object, dict[object, float]] = {
            u: {v: f for v, f in out.items() if f > 0} for u, out in flow.items()
        }
        paths: list[tuple[int, tuple[str, ...], float]] = []
        while residual.get("*"):
            walk = _walk(residual)
            if walk is None:
                break  # what is left is a circulation the max flow happened to carry
            rate = min(residual[u][v] for u, v in itertools.pairwise(walk))
            for u, v in itertools.pairwise(walk):
                residual[u][v] -= rate
                if residual[u][v] <= rate * 1e-12:
                    del residual[u][v]
            part = walk[1] if self.gather else walk[-2]
            assert isinstance(part, tuple)
            paths.append((int(part[1]), self._devices(walk), rate))
        return FlowSchedule(lam, tuple(paths))

    @staticmethod
    def _devices(walk: Sequence[object]) -> tuple[str, ...]:
        """The devices of a flow path (split nodes merged, the terminals dropped)."""
        out: list[str] = []
        for node in walk:
            if node in ("*", "#") or (isinstance(node, tuple) and node[0] == "part"):
                continue
            name = node[1] if isinstance(node, tuple) else node
            assert isinstance(name, str)
            if not out or out[-1] != name:
                out.append(name)
        return tuple(out)


def _walk(residual: Mapping[object, Mapping[object, float]]) -> list[object] | None:
    """A path of positive flow from "*" to "#" (depth first, no node twice)."""
    stack: list[tuple[object, list[object]]] = [("*", ["*"])]
    seen: set[object] = {"*"}
    while stack:
        node, walk = stack.pop()
        if node == "#":
            return walk
        for nxt in residual.get(node, {}):
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*walk, nxt]))
    return None


def schedule_hops(flow: DemandFlow, schedule: FlowSchedule) -> tuple[list[Hop], list[int]]:
    """Each group's bytes (its parts in order) split over its paths in proportion to their
    flow (integer boundaries, the last path takes the rest), as hops cut at every GPU a
    path passes, each hop at its path's rate; and the group of each hop."""
    by_group: dict[int, list[tuple[tuple[str, ...], float]]] = {}
    for g, devices, rate in schedule.paths:
        by_group.setdefault(g, []).append((devices, rate))
    hops: list[Hop] = []
    owner: list[int] = []
    for g, group in enumerate(flow.groups):
        paths = by_group.get(g, [])
        size = sum(d.num_bytes for d in group)
        total = sum(rate for _, rate in paths)
        lo = 0
        acc = 0.0
        for index, (devices, rate) in enumerate(paths):
            acc += rate
            hi = size if index == len(paths) - 1 else int(size * acc / total)
            cuts = [i for i, name in enumerate(devices) if flow.network.is_gpu[name]]
            for start, length in _ranges(group, lo, hi):
                after: int | None = None
                for a, b in itertools.pairwise(cuts):
                    path = devices[a : b + 1]
                    hops.append(Hop(path[0], path[-1], path, start, length, 1, after, 0, rate))
                    owner.append(g)
                    after = len(hops) - 1
            lo = max(lo, hi)
    return hops, owner


def _ranges(group: Sequence[Demand], lo: int, hi: int) -> list[tuple[int, int]]:
    """Byte ranges (offset, length) of [lo, hi) of the group's parts laid end to end."""
    out = []
    base = 0
    for d in group:
        a, b = max(lo, base), min(hi, base + d.num_bytes)
        if b > a:
            out.append((d.offset_bytes + a - base, b - a))
        base += d.num_bytes
    return out
