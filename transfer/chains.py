"""Chains on links of their own: broadcasts for fabrics whose switches cannot duplicate.

Under PCIe switches a GPU's out-link is often the max-flow rate itself, so at that rate
every GPU of a broadcast tree has one child: the tree is a chain, and its hops must not
share a link. `disjoint_chain` routes each next hop over what the chain's earlier hops
left. A chain of n GPUs pays n - 1 pieces of pipeline fill and n message delays;
`paired_chains` halves that depth: GPUs are paired with their nearest (under one PCIe
switch), two trees at half the rate each run a chain through one GPU of every pair, and
each chain GPU hands the bytes to its mate as well (its out-link: half the rate to the
next, half to the mate), so each GPU is a chain link in one tree and a leaf in the other
(the two trees of NCCL's double binary tree, as chains of pairs).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Sequence

from wasma.transfer.costmodel import LinkTable
from wasma.transfer.packing import FlowNetwork, Resource, Tree, TreeHop
from wasma.transfer.rails import widest_next


def disjoint_chain(
    table: LinkTable, network: FlowNetwork, src: str, dsts: Sequence[str], rate_Bps: float
) -> tuple[Tree, float] | None:
    """A chain from `src` through every destination whose hops keep to links and device
    limits the chain's earlier hops left room on: each next destination the nearest (least
    latency, never through another GPU) still reachable at `rate_Bps`, or where none is,
    the one behind the widest path; and the chain's rate (each resource's capacity over
    the times the chain crosses it). Where no switch duplicates (PCIe), a chain is the one
    tree that carries a broadcast at a GPU's full out-link rate, as every GPU has one
    child; the shape algorithms' ring picks paths without knowing what its other hops
    took, and the packed trees there stop short of the bound."""
    left = dict(network.capacity)
    hops: list[TreeHop] = []
    used: Counter[Resource] = Counter()
    here = src
    todo = [d for d in dict.fromkeys(dsts) if d != src]
    while todo:
        found = _nearest_at(table, network, here, set(todo), left, rate_Bps)
        if found is None:
            found = widest_next(network, here, todo, left)
            if found is None:
                return None
        d, path = found
        hops.append(TreeHop(here, d, path, len(hops) - 1 if hops else None))
        for key in (*itertools.pairwise(path), *path[1:-1]):
            if key in network.capacity:
                used[key] += 1
                left[key] -= rate_Bps
        here = d
        todo.remove(d)
    if not hops:
        return None
    return tuple(hops), min(network.capacity[key] / n for key, n in used.items())


def _nearest_at(
    table: LinkTable,
    network: FlowNetwork,
    src: str,
    targets: set[str],
    left: dict[Resource, float],
    rate_Bps: float,
) -> tuple[str, tuple[str, ...]] | None:
    """The target nearest `src` (least latency) over links and devices with `rate_Bps`
    left, through non-GPU devices only, and the path there; None if none is."""
    need = rate_Bps * (1 - 1e-9)
    dist = {src: 0.0}
    previous: dict[str, str] = {}
    heap = [(0.0, src)]
    done: set[str] = set()
    while heap:
        d, node = heapq.heappop(heap)
        if node in done:
            continue
        done.add(node)
        if node in targets:
            path = [node]
            while path[-1] != src:
                path.append(previous[path[-1]])
            return node, tuple(reversed(path))
        if node != src and network.is_gpu[node]:
            continue
        for nxt in network.adjacent[node]:
            if left.get((node, nxt), 0.0) < need or nxt in done:
                continue
            if not network.is_gpu[nxt] and nxt in network.capacity and left[nxt] < need:
                continue
            nd = d + table.latency(node, nxt)
            if nd < dist.get(nxt, math.inf):
                dist[nxt] = nd
                previous[nxt] = node
                heapq.heappush(heap, (nd, nxt))
    return None


class _Router:
    """Routes hops of trees at `rate_Bps` each over what earlier hops left."""

    def __init__(self, table: LinkTable, network: FlowNetwork, rate_Bps: float) -> None:
        self.table = table
        self.network = network
        self.rate = rate_Bps
        self.left = dict(network.capacity)

    def route(self, src: str, targets: Sequence[str]) -> tuple[str, tuple[str, ...]] | None:
        """The nearest of `targets` reachable at the rate, and its path; that taken."""
        found = _nearest_at(self.table, self.network, src, set(targets), self.left, self.rate)
        if found is not None:
            for key in (*itertools.pairwise(found[1]), *found[1][1:-1]):
                if key in self.left:
                    self.left[key] -= self.rate
        return found


def mates(table: LinkTable, gpus: Sequence[str]) -> list[tuple[str, str | None]]:
    """`gpus` in pairs, the first with the GPU nearest it (least path latency, never
    through another GPU: two under one PCIe switch), greedily in order; an odd one out
    alone."""
    left = list(gpus)
    out: list[tuple[str, str | None]] = []
    while left:
        here = left.pop(0)
        if not left:
            out.append((here, None))
            break
        near = min(left, key=lambda g: (_latency(table, here, g), left.index(g)))
        left.remove(near)
        out.append((here, near))
    return out


def _latency(table: LinkTable, a: str, b: str) -> float:
    return sum(table.latency(*link) for link in itertools.pairwise(table.path(a, b)))


def paired_chains(
    table: LinkTable, network: FlowNetwork, src: str, dsts: Sequence[str], rate_Bps: float
) -> list[Tree] | None:
    """Two trees from `src` through every destination, each at half of `rate_Bps`: pairs
    of mates (`mates`, the source's first); tree A chains through the first GPU of each
    pair from the source on, tree B from the source's mate through the second of each
    pair, every chain GPU passing the bytes to its mate too; the chain's last GPU sends to
    whoever that leaves out (in A the source's mate, in B an odd one out without a mate).
    None where some hop finds no path at that rate."""
    pairs = mates(table, [src, *(d for d in dict.fromkeys(dsts) if d != src)])
    mate_of = {a: b for a, b in pairs if b is not None} | {b: a for a, b in pairs if b}
    first = pairs[0][1]
    if first is None or len(pairs) < 2:
        return None
    router = _Router(table, network, rate_Bps / 2)
    heads = [a for a, _ in pairs[1:]]
    tails = [b for _, b in pairs[1:] if b is not None]
    everyone = [g for pair in pairs for g in pair if g is not None]
    trees = [
        _chain_tree(router, src, None, heads, mate_of, everyone),
        _chain_tree(router, src, first, tails, mate_of, everyone),
    ]
    return None if any(t is None for t in trees) else [t for t in trees if t is not None]


def _chain_tree(
    router: _Router,
    src: str,
    start: str | None,
    chain: Sequence[str],
    mate_of: dict[str, str],
    last: Sequence[str],
) -> Tree | None:
    """`src` (to `start` first, if given), then a chain through `chain` (each next the
    nearest reachable), each chain GPU passing the bytes to its mate, and the chain's end
    to each of `last` still without them; None where a hop finds no path at the router's
    rate."""
    hops: list[TreeHop] = []
    holder: dict[str, int | None] = {src: None}
    here = src

    def send(a: str, targets: Sequence[str]) -> str | None:
        found = router.route(a, targets)
        if found is None:
            return None
        hops.append(TreeHop(a, found[0], found[1], holder[a]))
        holder[found[0]] = len(hops) - 1
        return found[0]

    if start is not None:
        if send(src, [start]) is None:
            return None
        here = start
    todo = list(chain)
    while todo:
        nxt = send(here, todo)
        if nxt is None:
            return None
        here = nxt
        todo.remove(here)
        mate = mate_of.get(here)
        if mate is not None and mate not in holder and send(here, [mate]) is None:
            return None
    for g in last:
        if g not in holder and send(here, [g]) is None:
            return None
    return tuple(hops)
