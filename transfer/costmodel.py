"""The alpha-beta link model and the plan evaluator every planner choice is priced with.

A piece of m bytes on a hop holds the hop's path for m / beta_eff plus its share of the
per-message software cost, and lands a path latency (and the rest of that cost) later:
propagation does not block the next piece. Up to `message_window` pieces of a hop are in
flight at once (NCCL keeps 8 steps in flight per channel, GPU copy engines queue copies),
so each piece holds the path for per_message_s / window of its fixed cost; with a window
of 1 (the CPU executor: one process copies piece after piece) a piece pays all of it.
beta_eff is the narrowest link's bandwidth divided by the number of transfers on it at
once (the plan's own concurrent hops plus transfers other plans reserved), or the rate a
fluid schedule assigned the hop (`Hop.rate_Bps`). A hop's first piece waits for its
start-up, `per_hop_s`. Hops run as a chunk-level dataflow: a piece is sent once the
previous piece on that hop is out and the piece has arrived at the sender.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from wasma.transfer.plan import Hop, fork_of, group_of, multicast_groups, own_links, own_nodes
from wasma.transfer.topology import Topology, TopologyError

DirectedLink = tuple[str, str]


@dataclass(frozen=True)
class HopCost:
    occupy_s: float  # per piece, fixed time it holds the path besides its bytes
    delay_s: float  # per piece, from leaving the path to landing (latency, the rest)
    bandwidth_Bps: float  # after sharing
    bottleneck: tuple[DirectedLink, ...]  # the links that set bandwidth_Bps
    bottleneck_nodes: tuple[str, ...] = ()  # devices whose shared throughput sets it

    @property
    def alpha_s(self) -> float:
        """A lone piece's fixed cost: per-message overhead plus path latency."""
        return self.occupy_s + self.delay_s


class LinkTable:
    """Current per-direction link estimates: start from the topology, move with
    observations (`scale_bandwidth`), failures (`mark_down`) and concurrent load."""

    def __init__(
        self,
        topology: Topology,
        per_message_s: float = 5e-6,
        per_hop_s: float = 0.0,
        message_window: int = 16,
    ) -> None:
        if per_message_s < 0 or per_hop_s < 0:
            raise ValueError("per_message_s and per_hop_s must be >= 0")
        if isinstance(message_window, bool) or not isinstance(message_window, int):
            raise ValueError("message_window must be an integer >= 1")
        if message_window < 1:
            raise ValueError("message_window must be an integer >= 1")
        self.topology = topology
        self.per_message_s = per_message_s  # software cost of every piece sent
        # Pieces of one hop in flight at once: their fixed costs overlap (see above).
        self.message_window = message_window
        # Start-up of a hop (a stream, a thread) before its first piece can go; every hop
        # starts up at once when the transfer begins, so it overlaps waiting for data.
        self.per_hop_s = per_hop_s
        self._bandwidth: dict[DirectedLink, float] = {}
        self._latency: dict[DirectedLink, float] = {}
        for link in topology.links():
            self._bandwidth[link.u, link.v] = link.bandwidth_Bps
            self._bandwidth[link.v, link.u] = link.back_Bps
            self._latency[link.u, link.v] = self._latency[link.v, link.u] = link.latency_s
        self._down: set[DirectedLink] = set()
        self._load: Counter[DirectedLink] = Counter()
        self._paths: dict[DirectedLink, tuple[str, ...]] = {}
        # Max-flow path sets per (src, dst, max paths): they read link bandwidths and
        # failures only, so reservations and latency updates keep them.
        self._flows: dict[tuple[str, str, int], tuple[tuple[str, ...], ...]] = {}
        self._neighbors = {d.name: sorted(topology.neighbors(d.name)) for d in topology.devices()}
        self._is_gpu = {d.name: d.kind == "gpu" for d in topology.devices()}
        self._throughput = {
            d.name: d.throughput_Bps for d in topology.devices() if d.throughput_Bps is not None
        }
        self.version = 0  # bumps on every change, so callers can drop memoised prices
        # Bumps when a link's bandwidth, latency or a device's throughput is set (learned
        # from measurements): with the failures and the reservations, all a price reads.
        self._tuned = 0
        self._state: tuple[int, frozenset[DirectedLink], frozenset[tuple[DirectedLink, int]]]
        self._state = self._state_now()

    # state -------------------------------------------------------------------------------
    def _changed(self, capacity: bool = True, tuned: bool = False) -> None:
        self._paths.clear()
        if capacity:
            self._flows.clear()
        if tuned:
            self._tuned += 1
        self.version += 1
        self._state = self._state_now()

    def _state_now(
        self,
    ) -> tuple[int, frozenset[DirectedLink], frozenset[tuple[DirectedLink, int]]]:
        return (self._tuned, frozenset(self._down), frozenset(self._load.items()))

    @property
    def state(self) -> Hashable:
        """Everything a plan's price depends on, as a key: two moments with equal keys
        price every plan alike. Unlike `version`, a reservation released brings the key
        back (the common case: a transfer's links are loaded while it runs, idle after)."""
        return self._state

    @property
    def as_built(self) -> bool:
        """No speed learned, nothing down, nothing reserved."""
        return self._state == (0, frozenset(), frozenset())

    def _check(self, u: str, v: str) -> DirectedLink:
        if (u, v) not in self._bandwidth:
            raise TopologyError(f"no link between {u!r} and {v!r}")
        return (u, v)

    def bandwidth(self, u: str, v: str) -> float:
        return self._bandwidth[self._check(u, v)]

    def latency(self, u: str, v: str) -> float:
        return self._latency[self._check(u, v)]

    def capacity(self, u: str, v: str) -> float:
        """What a new plan may use of u -> v: its bandwidth split with the transfers
        reserved on it; 0 when it is down."""
        link = self._check(u, v)
        if link in self._down:
            return 0.0
        return self._bandwidth[link] / (1 + self._load.get(link, 0))

    def directed_links(self) -> list[DirectedLink]:
        return list(self._bandwidth)

    def throughputs(self) -> dict[str, float]:
        """Devices with a shared throughput limit, and the limit."""
        return dict(self._throughput)

    def set_bandwidth(self, u: str, v: str, bandwidth_Bps: float) -> None:
        if not bandwidth_Bps > 0:
            raise ValueError("bandwidth must be positive")
        self._bandwidth[self._check(u, v)] = bandwidth_Bps
        self._changed(tuned=True)

    def throughput(self, node: str) -> float | None:
        return self._throughput.get(node)

    def set_throughput(self, node: str, throughput_Bps: float) -> None:
        if node not in self._throughput:
            raise TopologyError(f"device {node!r} has no shared throughput limit")
        if not throughput_Bps > 0:
            raise ValueError("throughput must be positive")
        self._throughput[node] = throughput_Bps
        self._changed(capacity=False, tuned=True)

    def set_latency(self, u: str, v: str, latency_s: float) -> None:
        if not latency_s >= 0:
            raise ValueError("latency must be >= 0")
        self._latency[self._check(u, v)] = latency_s
        self._changed(capacity=False, tuned=True)

    def mark_down(self, u: str, v: str) -> None:
        """Both directions: a failed cable or port carries nothing either way."""
        self._down.update({self._check(u, v), self._check(v, u)})
        self._changed()

    def mark_up(self, u: str, v: str) -> None:
        self._down.difference_update({self._check(u, v), self._check(v, u)})
        self._changed()

    def is_down(self, u: str, v: str) -> bool:
        return (u, v) in self._down

    def add_load(self, links: Iterable[DirectedLink], count: int = 1) -> None:
        for link in links:
            self._load[self._check(*link)] += count
            if self._load[link] <= 0:
                del self._load[link]
        self._changed(capacity=False)

    @property
    def load(self) -> dict[DirectedLink, int]:
        """Transfers reserved on each directed link (the link-load map)."""
        return dict(self._load)

    # paths -------------------------------------------------------------------------------
    def flows(
        self,
        src: str,
        dst: str,
        max_paths: int,
        compute: Callable[[], Sequence[tuple[str, ...]]],
    ) -> list[tuple[str, ...]]:
        """`compute()` (a max-flow path decomposition), memoised until a link's bandwidth
        or state changes: pricing a pair at every size octave reuses one max flow."""
        key = (src, dst, max_paths)
        found = self._flows.get(key)
        if found is None:
            found = self._flows[key] = tuple(compute())
        return list(found)

    def path(
        self, src: str, dst: str, busy: Mapping[DirectedLink, int] | None = None
    ) -> tuple[str, ...]:
        """The widest path (largest bottleneck bandwidth after load, then least latency),
        not routed through other GPUs unless nothing else connects the two. `busy` counts
        links the caller's own plan already uses, so its hops spread over parallel links
        (two GPUs behind one PCIe switch take its two NICs, not both the first)."""
        key = (src, dst)
        cached = self._paths.get(key)
        if cached is None:
            cached = self._find(src, dst, None)
            self._paths[key] = cached
        if busy and any(link in busy for link in itertools.pairwise(cached)):
            return self._find(src, dst, busy)
        return cached

    def _find(self, src: str, dst: str, busy: Mapping[DirectedLink, int] | None) -> tuple[str, ...]:
        self.topology.require(src)
        self.topology.require(dst)
        path = self._widest(src, dst, busy, through_gpus=False) or self._widest(
            src, dst, busy, through_gpus=True
        )
        if path is None:
            raise TopologyError(f"no working path from {src} to {dst} (links down?)")
        return path

    def _effective(self, link: DirectedLink, busy: Mapping[DirectedLink, int] | None) -> float:
        extra = busy.get(link, 0) if busy else 0
        return self._bandwidth[link] / (1 + self._load.get(link, 0) + extra)

    def _widest(
        self,
        src: str,
        dst: str,
        busy: Mapping[DirectedLink, int] | None,
        *,
        through_gpus: bool,
    ) -> tuple[str, ...] | None:
        best: dict[str, tuple[float, float]] = {src: (-float("inf"), 0.0)}
        previous: dict[str, str] = {}
        heap: list[tuple[float, float, str]] = [(-float("inf"), 0.0, src)]
        done: set[str] = set()
        while heap:
            neg_width, latency, node = heapq.heappop(heap)
            if node in done:
                continue
            done.add(node)
            if node == dst:
                break
            if node != src and self._is_gpu[node] and not through_gpus:
                continue
            for nxt in self._neighbors[node]:
                link = (node, nxt)
                if link in self._down or nxt in done:
                    continue
                width = min(-neg_width, self._effective(link, busy))
                key = (-width, latency + self._latency[link])
                if nxt not in best or key < best[nxt]:
                    best[nxt] = key
                    previous[nxt] = node
                    heapq.heappush(heap, (key[0], key[1], nxt))
        if dst not in done:
            return None
        path = [dst]
        while path[-1] != src:
            path.append(previous[path[-1]])
        return tuple(reversed(path))

    # pricing -----------------------------------------------------------------------------
    def hop_costs(
        self, hops: Sequence[Hop], peers: Sequence[Collection[int]] | None = None
    ) -> list[HopCost]:
        """Per hop alpha and bandwidth. A link (or a device with a throughput cap) is split
        evenly among the hops in `peers[i]` that use it (default: every hop of the same
        round, i.e. all assumed concurrent), plus the transfers reserved on it."""
        if peers is None:
            by_stage: dict[int, set[int]] = {}
            for index, hop in enumerate(hops):
                by_stage.setdefault(hop.stage, set()).add(index)
            peers = [by_stage[hop.stage] for hop in hops]
        self._check_forks(hops)
        # A multicast counts once on every link and device its hops pass (`own_links`):
        # users are counted by multicast, rates summed over what each hop adds.
        group = [group_of(i, h) for i, h in enumerate(hops)]
        links_added = own_links(hops)
        nodes_added = own_nodes(hops)
        link_users: dict[DirectedLink, set[int]] = {}
        node_users: dict[str, set[int]] = {}
        for index, hop in enumerate(hops):
            for link in hop.links():
                link_users.setdefault(link, set()).add(index)
            for node in hop.path[1:-1]:
                if node in self._throughput:
                    node_users.setdefault(node, set()).add(index)
        rated: dict[DirectedLink, float] = {}
        rated_nodes: dict[str, float] = {}
        for index, hop in enumerate(hops):
            if hop.rate_Bps is not None:
                for link in links_added[index]:
                    rated[link] = rated.get(link, 0.0) + hop.rate_Bps
                for node in nodes_added[index]:
                    rated_nodes[node] = rated_nodes.get(node, 0.0) + hop.rate_Bps
        occupy = self.per_message_s / self.message_window
        costs = []
        for index, hop in enumerate(hops):
            mates = peers[index]
            latency = 0.0
            width = float("inf")
            bottleneck: list[DirectedLink] = []
            for link in hop.links():
                if link in self._down:
                    raise TopologyError(
                        f"hop {hop.src} -> {hop.dst} uses link "
                        f"{link[0]} -> {link[1]}, which is down"
                    )
                latency += self._latency[link]
                if hop.rate_Bps is not None:
                    # A fluid schedule fixed the rate; the link's most loaded users set it.
                    share = self._bandwidth[link] / (1 + self._load.get(link, 0))
                    share *= hop.rate_Bps / rated[link]
                else:
                    users = len({group[j] for j in link_users[link] if j == index or j in mates})
                    share = self._bandwidth[link] / (users + self._load.get(link, 0))
                if share < width * (1 - 1e-12):
                    width, bottleneck = share, [link]
                elif share <= width * (1 + 1e-12):
                    bottleneck.append(link)
            nodes: list[str] = []
            for node in hop.path[1:-1]:
                capacity = self._throughput.get(node)
                if capacity is None:
                    continue
                if hop.rate_Bps is not None:
                    share = capacity * hop.rate_Bps / rated_nodes[node]
                else:
                    users = len({group[j] for j in node_users[node] if j == index or j in mates})
                    share = capacity / users
                if share < width * (1 - 1e-12):
                    width, bottleneck, nodes = share, [], [node]
                elif share <= width * (1 + 1e-12):
                    nodes.append(node)
            if hop.rate_Bps is not None:
                # The assigned rate, unless the links (after failures or reservations
                # since the plan was made) can no longer carry it.
                width = min(width, hop.rate_Bps)
            costs.append(
                HopCost(
                    occupy,
                    self.per_message_s - occupy + latency,
                    width,
                    tuple(bottleneck),
                    tuple(nodes),
                )
            )
        return costs

    def _check_forks(self, hops: Sequence[Hop]) -> None:
        """Every multicast forks at a device the topology says multicasts."""
        for first, members in multicast_groups(hops).items():
            _, fork = fork_of([hops[i].path for i in members])
            if fork not in self.topology or not self.topology.can_multicast(fork):
                raise TopologyError(f"multicast {first} forks at {fork}, which cannot multicast")

    def timed_costs(self, hops: Sequence[Hop]) -> list[HopCost]:
        """Hop costs with sharing among hops that overlap in time.

        A first pass assumes every hop of a round runs at once; its timeline then says
        which hops really overlap (an unpipelined chain's hops run one after another and
        do not share a thing), and the costs are recomputed with only those."""
        first = self.hop_costs(hops)
        if all(h.rate_Bps is not None for h in hops):
            return first  # a fluid schedule's rates do not depend on who overlaps whom
        spans = self._simulate(hops, first, 1.0)
        overlapping = [
            {j for j, (b0, b1) in enumerate(spans) if b0 < a1 and a0 < b1} for a0, a1 in spans
        ]
        return self.hop_costs(hops, overlapping)

    def evaluate(self, hops: Sequence[Hop], *, bandwidth_scale: float = 1.0) -> float:
        """Predicted completion time of the whole plan, in seconds."""
        return max(self.finish_times(hops, bandwidth_scale=bandwidth_scale), default=0.0)

    def finish_times(self, hops: Sequence[Hop], *, bandwidth_scale: float = 1.0) -> list[float]:
        """When each hop's last piece lands, in seconds from the start."""
        spans = self._simulate(hops, self.timed_costs(hops), bandwidth_scale)
        return [end for _, end in spans]

    def _simulate(
        self, hops: Sequence[Hop], costs: Sequence[HopCost], bandwidth_scale: float
    ) -> list[tuple[float, float]]:
        """(start of first piece, arrival of last piece) per hop, as a piece dataflow."""
        done: list[list[float]] = []  # per hop, arrival time of each piece
        bounds_of: list[list[tuple[int, int]]] = []  # per hop, its pieces
        spans: list[tuple[float, float]] = []
        stage_end: dict[int, float] = {}
        for index, (hop, cost) in enumerate(zip(hops, costs, strict=True)):
            if hop.after is not None and not 0 <= hop.after < index:
                raise ValueError(f"hop {index}: 'after' must name an earlier hop")
            if index and hop.stage < hops[index - 1].stage:
                raise ValueError("hops must be listed in stage order")
            # A stage is a round barrier: it starts when all earlier rounds are done.
            start = max((end for s, end in stage_end.items() if s < hop.stage), default=0.0)
            bounds = hop.chunk_bounds()
            bounds_of.append(bounds)
            beta = cost.bandwidth_Bps * bandwidth_scale
            if hop.num_bytes and not beta > 0:
                raise ValueError(f"hop {index} has no usable bandwidth")
            ready: Sequence[float] = [start] * len(bounds)
            if hop.after is not None and bounds:
                parent = hops[hop.after]
                lo, hi = bounds[0][0], bounds[-1][1]  # the pieces tile [lo, hi) in order
                if not (parent.offset_bytes <= lo and hi <= parent.offset_bytes + parent.num_bytes):
                    raise ValueError(f"hop {index} forwards bytes its parent does not get")
                ready = self._ready(bounds, bounds_of[hop.after], done[hop.after], start)
            pieces: list[float] = []
            free = start + self.per_hop_s
            first = max(free, ready[0]) if bounds else None
            occupy, delay = cost.occupy_s, cost.delay_s
            for (lo, hi), at in zip(bounds, ready, strict=True):
                begin = free if free >= at else at
                free = begin + occupy + (hi - lo) / beta
                pieces.append(free + delay)
            done.append(pieces)
            end = pieces[-1] if pieces else free
            spans.append((start if first is None else first, end))
            stage_end[hop.stage] = max(stage_end.get(hop.stage, 0.0), end)
        return spans

    @staticmethod
    def _ready(
        bounds: Sequence[tuple[int, int]],
        parent_bounds: Sequence[tuple[int, int]],
        parent_done: Sequence[float],
        start: float,
    ) -> list[float]:
        """When each piece is at the sender: once the parent's piece holding its last
        byte is in (and not before its round starts)."""
        if bounds == parent_bounds:  # the usual case: a tree forwards its parent's pieces
            return [at if at > start else start for at in parent_done]
        out = []
        cursor = 0
        for _, hi in bounds:
            while parent_bounds[cursor][1] < hi:
                cursor += 1
            at = parent_done[cursor]
            out.append(at if at > start else start)
        return out


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of t = alpha + size / beta; returns (alpha_s, beta_Bps).

    How the model is calibrated from measured point-to-point transfers."""
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError("need at least two (size, time) samples")
    n = len(sizes)
    mean_x = sum(sizes) / n
    mean_y = sum(times) / n
    var = sum((x - mean_x) ** 2 for x in sizes)
    if var == 0:
        raise ValueError("need samples of at least two different sizes")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, times, strict=True)) / var
    if slope <= 0:
        raise ValueError("times do not grow with size; cannot fit a bandwidth")
    alpha = max(0.0, mean_y - slope * mean_x)
    return alpha, 1.0 / slope
