"""Broadcast at the bandwidth bound: the max-flow bound and a packing of trees that meets it.

The bound (Edmonds): bytes held by a set of holders reach every destination no faster
than the smallest, over destinations, of the max flow from the holders to it. Every GPU
may store and forward (relay); switches, NICs and CPUs only route, so a tree is a set of
GPU-to-GPU hops, each a path through non-GPU devices, and a hop's links and the shared
throughput of the devices it passes (a PCIe switch, a CPU doing copies) are what it uses.

The schedule: a fractional packing of such trees (Blink, ForestColl), found by
multiplicative weights (Garg-Koenemann): each round grows the cheapest tree under the
current resource lengths (Prim over GPUs, Dijkstra through the fabric, any GPU a relay),
sends what its bottleneck allows, and lengthens what it used in proportion to the load.
The rounds stop once the packing (scaled to fit every capacity) is within a few percent of
the bound; a greedy pass then hands each tree the capacity left on its links. Each tree
carries a share of the bytes in proportion to its rate, pipelined in pieces.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import networkx as nx

from wasma.transfer.costmodel import LinkTable
from wasma.transfer.plan import Hop, group_of, own_links, own_nodes

Resource = tuple[str, str] | str  # a directed link, or a device with a throughput limit


@dataclass(frozen=True)
class TreeHop:
    src: str
    dst: str
    path: tuple[str, ...]
    parent: int | None  # the hop of the same tree that delivers to src; None: src holds it
    # The tree's hop that starts the multicast this hop belongs to (`Hop.multicast`, in
    # the tree's own numbering); None: a hop of its own.
    multicast: int | None = None


Tree = tuple[TreeHop, ...]


@dataclass(frozen=True)
class Packing:
    """Trees with their rates; `rate_Bps` (their sum) is what every destination gets."""

    trees: tuple[tuple[Tree, float], ...]
    rate_Bps: float
    bound_Bps: float  # the max-flow rate of the worst destination
    rounds: int  # multiplicative-weight rounds it took

    def hops(self, num_bytes: int, shares: Sequence[float] | None = None) -> list[Hop]:
        """The packing as plan hops: tree i carries a contiguous share of the bytes in
        proportion to its rate, or to `shares[i]` (integer boundaries), each hop at its
        tree's rate."""
        out: list[Hop] = []
        weights = list(shares) if shares is not None else [rate for _, rate in self.trees]
        total = sum(weights)
        acc = 0.0
        lo = 0
        for index, ((tree, rate), weight) in enumerate(zip(self.trees, weights, strict=True)):
            acc += weight
            hi = num_bytes if index == len(self.trees) - 1 else int(num_bytes * acc / total)
            if hi <= lo:
                continue
            base = len(out)
            for hop in tree:
                after = None if hop.parent is None else base + hop.parent
                group = None if hop.multicast is None else base + hop.multicast
                out.append(
                    Hop(hop.src, hop.dst, hop.path, lo, hi - lo, 1, after, 0, rate, multicast=group)
                )
            lo = hi
        return out


def work_conserving(table: LinkTable, hops: Sequence[Hop]) -> list[Hop]:
    """`hops` (a fluid schedule, every hop at its tree's rate) with each hop raised to
    its share of what its links and devices can carry, in proportion to the rates that
    share them. A tree's rate is its bottleneck's; on its other links it would leave
    capacity idle, and there each piece's time in transit (the pipeline's fill) would be
    the bottleneck's. Still feasible: on every link the raised rates sum to at most its
    capacity (each hop is raised by its most loaded link's factor, or less)."""
    on_link: dict[tuple[str, str], float] = {}
    on_node: dict[str, float] = {}
    links_added = own_links(hops)
    nodes_added = own_nodes(hops)
    for index, hop in enumerate(hops):
        rate = hop.rate_Bps or 0.0
        for link in links_added[index]:
            on_link[link] = on_link.get(link, 0.0) + rate
        for node in nodes_added[index]:
            if table.throughput(node) is not None:
                on_node[node] = on_node.get(node, 0.0) + rate
    factors: dict[int, float] = {}
    for index, hop in enumerate(hops):
        if not hop.rate_Bps:
            continue
        factor = min(
            (table.capacity(*link) / on_link[link] for link in hop.links()),
            default=1.0,
        )
        for node in hop.path[1:-1]:
            cap = table.throughput(node)
            if cap is not None:
                factor = min(factor, cap / on_node[node])
        # A multicast's hops are one send: all raised by the least factor of its links.
        key = group_of(index, hop)
        factors[key] = min(factors.get(key, math.inf), factor)
    out = []
    for index, hop in enumerate(hops):
        if not hop.rate_Bps:
            out.append(hop)
            continue
        factor = factors[group_of(index, hop)]
        out.append(replace(hop, rate_Bps=hop.rate_Bps * max(1.0, factor)))
    return out


class FlowNetwork:
    """Directed capacities, latencies and device limits read from a `LinkTable` once.

    `hosts` keeps only the devices of those machines (and, with more than one, the network
    between them): a packing for GPUs of two nodes need not search the other nodes."""

    def __init__(self, table: LinkTable, hosts: Iterable[str] | None = None) -> None:
        topology = table.topology
        keep = set(hosts) if hosts is not None else None
        devices = [
            d
            for d in topology.devices()
            if keep is None
            or d.host in keep
            or (d.host == d.name and d.kind == "switch" and len(keep) > 1)
        ]
        self.is_gpu = {d.name: d.kind == "gpu" for d in devices}
        self.capacity: dict[Resource, float] = {}
        self.adjacent: dict[str, list[str]] = {name: [] for name in self.is_gpu}
        for u, v in table.directed_links():
            c = table.capacity(u, v)
            if c > 0 and u in self.is_gpu and v in self.is_gpu:
                self.capacity[u, v] = c
                self.adjacent[u].append(v)
        for node, limit in table.throughputs().items():
            if node in self.is_gpu:
                self.capacity[node] = limit
        for neighbours in self.adjacent.values():
            neighbours.sort()

    # the bound ---------------------------------------------------------------------------
    def split_graph(self) -> nx.DiGraph:
        """The capacities as a flow graph: a device with a throughput limit split into
        `inlet(d) -> outlet(d)` carrying it, every link `outlet(u) -> inlet(v)`."""
        graph = nx.DiGraph()
        for key, c in self.capacity.items():
            if isinstance(key, str):
                graph.add_edge(("in", key), ("out", key), capacity=c)
        for key, c in self.capacity.items():
            if isinstance(key, tuple):
                u, v = key
                graph.add_edge(self.outlet(u), self.inlet(v), capacity=c)
        return graph

    def max_flow_Bps(self, holders: Sequence[str], dst: str) -> float:
        """Max flow from the holders (together) to `dst`; any GPU may relay."""
        graph = self.split_graph()
        for holder in holders:
            graph.add_edge("*", self.outlet(holder))  # no capacity: unbounded
        target = self.inlet(dst)
        if target not in graph or "*" not in graph:
            return 0.0
        return float(nx.maximum_flow_value(graph, "*", target))

    def cut_terms(
        self, table: LinkTable, holders: Sequence[str], dsts: Sequence[str]
    ) -> list[CutTerms]:
        """Per destination, the max-flow rate to it and, for two holder-to-it cuts,
        (capacity, the least latency from the cut to it): the min cut nearest the holders
        and the holders' own out-links. Each gives a lower bound (`bound_from_cuts`)."""
        graph = self.split_graph()
        for holder in holders:
            graph.add_edge("*", self.outlet(holder))  # no capacity: unbounded
        reverse = nx.DiGraph()
        reverse.add_nodes_from(graph)
        names = nx.DiGraph()
        for a, b in graph.edges:
            if a == "*":
                continue
            reverse.add_edge(b, a, weight=_edge_latency(table, a, b))
            u, v = _name(a), _name(b)
            if u != v:
                names.add_edge(u, v, weight=table.latency(u, v))
        # Hops start at GPUs (holders and relays): before any link, a hop's path has run
        # at least the latency from the nearest GPU to the link's near end.
        gpus = [n for n in names if table.topology.kind_of(n) == "gpu"]
        from_gpu = nx.multi_source_dijkstra_path_length(names, gpus) if gpus else {}
        at_holders = {"*", *(self.outlet(h) for h in holders), *(self.inlet(h) for h in holders)}
        out: list[CutTerms] = []
        for dst in dsts:
            target = self.inlet(dst)
            if target not in graph or "*" not in graph:
                out.append((0.0, ()))
                continue
            to_dst = nx.single_source_dijkstra_path_length(reverse, target)
            rate, (near, _) = nx.minimum_cut(graph, "*", target)
            terms = []
            for side in (set(near), at_holders):
                # Only links whose far end reaches dst carry bytes that get there.
                crossing = [
                    (a, b)
                    for a in side
                    if a != "*"
                    for b in graph.successors(a)
                    if b not in side and b in to_dst
                ]
                if crossing:
                    capacity = sum(graph.edges[a, b]["capacity"] for a, b in crossing)
                    after = min(
                        from_gpu.get(_name(a), 0.0) + _edge_latency(table, a, b) + to_dst[b]
                        for a, b in crossing
                    )
                    terms.append((capacity, after))
            out.append((float(rate), tuple(terms)))
        return out

    def inlet(self, node: str) -> object:
        """Where flow into `node` arrives in `split_graph`."""
        return ("in", node) if node in self.capacity else node

    def outlet(self, node: str) -> object:
        """Where flow out of `node` leaves in `split_graph`."""
        return ("out", node) if node in self.capacity else node

    # trees -------------------------------------------------------------------------------
    def grow_tree(
        self, holders: Sequence[str], dsts: Iterable[str], length: dict[Resource, float]
    ) -> Tree | None:
        """The cheapest tree under `length` that Prim's rule finds: repeatedly join the
        destination nearest the tree (Dijkstra from every GPU already in it, through the
        fabric and any GPU, which then relays). None if some destination is unreachable."""
        dist: dict[str, float] = {}
        previous: dict[str, str] = {}
        heap: list[tuple[float, str]] = []
        in_tree: set[str] = set()
        delivered_by: dict[str, int] = {}
        hops: list[TreeHop] = []
        left = set(dsts) - set(holders)

        def join(node: str) -> None:
            in_tree.add(node)
            dist[node] = 0.0
            heapq.heappush(heap, (0.0, node))

        for holder in holders:
            join(holder)
        while left:
            if not heap:
                return None
            d, node = heapq.heappop(heap)
            if d > dist.get(node, math.inf):
                continue
            if node in left:
                path = [node]
                while path[-1] not in in_tree:
                    path.append(previous[path[-1]])
                path.reverse()
                cuts = [i for i, n in enumerate(path) if self.is_gpu[n]]
                for a, b in itertools.pairwise(cuts):
                    src, dst = path[a], path[b]
                    hops.append(TreeHop(src, dst, tuple(path[a : b + 1]), delivered_by.get(src)))
                    delivered_by[dst] = len(hops) - 1
                for i in cuts[1:]:
                    left.discard(path[i])
                    join(path[i])
                continue
            for nxt in self.adjacent[node]:
                step = length[node, nxt]
                if not self.is_gpu[nxt] and nxt in self.capacity:
                    step += length[nxt]
                nd = d + step
                if nd < dist.get(nxt, math.inf) and nxt not in in_tree:
                    dist[nxt] = nd
                    previous[nxt] = node
                    heapq.heappush(heap, (nd, nxt))
        return tuple(hops)

    @staticmethod
    def usage(tree: Tree) -> Counter[Resource]:
        """Per link and device, how many times the tree's rate crosses it: once per hop,
        a multicast once on its shared prefix and once on each branch."""
        used: Counter[Resource] = Counter()
        shared: dict[int, set[Resource]] = {}
        for index, hop in enumerate(tree):
            counted = shared.setdefault(index if hop.multicast is None else hop.multicast, set())
            keys: list[Resource] = [*itertools.pairwise(hop.path), *hop.path[1:-1]]
            for key in keys:
                if key not in counted:
                    counted.add(key)
                    used[key] += 1
        return used

    def left_after(self, flows: Iterable[tuple[Counter[Resource], float]]) -> dict[Resource, float]:
        """What each link and device limit has left once trees of these usages carry
        these rates."""
        left = dict(self.capacity)
        for used, rate in flows:
            for key, n in used.items():
                if key in left:
                    left[key] -= rate * n
        return left

    def pack(
        self,
        holders: Sequence[str],
        dsts: Sequence[str],
        *,
        tolerance: float = 0.02,
        max_rounds: int = 400,
        epsilon: float = 1.0,
        check_every: int = 4,
        bound_Bps: float | None = None,
    ) -> Packing | None:
        """Trees and rates within `tolerance` of the bound (`bound_Bps`, or this network's
        own max-flow rate) where the rounds get there."""
        targets = [d for d in dict.fromkeys(dsts) if d not in holders]
        if not targets:
            return Packing((), 0.0, math.inf, 0)
        if any(d not in self.is_gpu for d in (*holders, *targets)):
            return None
        own = min(self.max_flow_Bps(holders, d) for d in targets)
        bound = own if bound_Bps is None else min(bound_Bps, own)
        if not bound > 0:
            return None
        length: dict[Resource, float] = {key: 1.0 / c for key, c in self.capacity.items()}
        flows: dict[Tree, float] = {}
        usages: dict[Tree, Counter[Resource]] = {}
        load: dict[Resource, float] = {}
        best: tuple[float, dict[Tree, float]] = (0.0, {})
        rounds = 0
        while rounds < max_rounds:
            rounds += 1
            tree = self.grow_tree(holders, targets, length)
            if tree is None:
                return None
            used = usages.setdefault(tree, self.usage(tree))
            amount = min(self.capacity[key] / n for key, n in used.items() if key in self.capacity)
            flows[tree] = flows.get(tree, 0.0) + amount
            for key, n in used.items():
                if key in self.capacity:
                    load[key] = load.get(key, 0.0) + amount * n
                    length[key] *= 1 + epsilon * amount * n / self.capacity[key]
            if rounds % check_every and rounds < max_rounds:
                continue
            # The packing so far, scaled to fit, then topped up with what is left.
            congestion = max(load[key] / self.capacity[key] for key in load)
            filled = self._fill({t: f / congestion for t, f in flows.items()}, usages, bound)
            rate = sum(filled.values())
            if rate > best[0]:
                best = (rate, filled)
            if rate >= (1 - tolerance) * bound:
                break
        ordered = sorted(best[1].items(), key=lambda kv: -kv[1])
        return Packing(tuple(ordered), best[0], bound, rounds)

    def _fill(
        self, flows: dict[Tree, float], usages: dict[Tree, Counter[Resource]], bound: float
    ) -> dict[Tree, float]:
        """Drop slivers (each tree costs messages), then give every tree, largest first,
        what its links have left, so no capacity the trees could use stays idle."""
        total = sum(flows.values())
        kept = {t: f for t, f in flows.items() if f >= 0.02 * total}
        left = self.left_after((usages[t], f) for t, f in kept.items())
        for _ in range(2):
            for tree in sorted(kept, key=lambda t: -kept[t]):
                room = min(
                    (max(0.0, left[key]) / n for key, n in usages[tree].items() if key in left),
                    default=0.0,
                )
                room = min(room, max(0.0, bound - sum(kept.values())))
                if room <= 0:
                    continue
                kept[tree] += room
                for key, n in usages[tree].items():
                    if key in left:
                        left[key] -= room * n
        return kept


CutTerms = tuple[float, tuple[tuple[float, float], ...]]


def _name(node: object) -> str:
    """The device a `split_graph` node stands for."""
    return str(node[1]) if isinstance(node, tuple) else str(node)


def _edge_latency(table: LinkTable, a: object, b: object) -> float:
    """A `split_graph` edge's latency: a link's, or 0 inside a split device."""
    u, v = _name(a), _name(b)
    return 0.0 if u == v else table.latency(u, v)


def bound_from_cuts(
    table: LinkTable, terms: Iterable[tuple[float, float]], num_bytes: int
) -> float:
    """The latest of `num_bytes / capacity + after` over the cuts, plus the fixed costs
    every plan pays: a lower bound of `LinkTable.evaluate` for any plan whose rates fit
    the capacities.

    Why, in that model: every byte a destination gets crosses each cut between the
    holders and it, inside some hop's piece, and the pieces on a link together move at
    most its capacity, so the cut is crossed at most `capacity` bytes a second. A piece
    starts no sooner than its hop's start-up (`per_hop_s`) and holds the path for its
    share of the message cost before its bytes count, so the last byte crosses no sooner
    than per_hop_s + occupy + bytes / capacity. That piece then lands the rest of the
    message cost plus its path's latency later, and later hops add theirs. Its hop starts
    at a GPU, so its path's latency is at least the least latency from any GPU to the
    crossed link, plus the link's, plus the least from its far end on to the destination
    (`after`). Not the least latency from a holder: a hop's pieces hold every link of
    their path at once and pay latency after, so a relay fed late can cross the cut
    while a hop from a holder, which pays the whole path's latency, crosses it early;
    adding bytes / capacity to the holder's latency overstates what such a plan pays."""
    worst = max((num_bytes / c + after for c, after in terms if c > 0), default=math.inf)
    return table.per_hop_s + table.per_message_s + worst


def latency_floor_s(table: LinkTable, holders: Sequence[str], dsts: Sequence[str]) -> float:
    """No byte lands before one message's fixed cost plus the least latency of any path
    from a holder: the worst destination's, over every working path."""
    graph = nx.DiGraph()
    for u, v in table.directed_links():
        if not table.is_down(u, v):
            graph.add_edge(u, v, weight=table.latency(u, v))
    for holder in holders:
        graph.add_edge("*", holder, weight=0.0)
    reach = nx.single_source_dijkstra_path_length(graph, "*")
    worst = max((reach.get(d, math.inf) for d in dsts if d not in holders), default=0.0)
    return worst + table.per_message_s
