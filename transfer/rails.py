"""Rail-aligned broadcast trees (NCCL's hierarchical broadcast, generalised): a shallow
packing for moves that cross hosts.

Lane r is the source host's r-th GPU (its owner) and the r-th GPU of every other host;
each GPU sends and receives between hosts through its own NIC (the nearest one the fewest
GPUs before it took), so on a rail-optimised fabric lane r stays on rail r. The bytes are
cut into sub-parts per lane. The source sends a sub-part over its host's fabric to the
lane's owner, which sends it over its rail to the lane's GPU on one other host, which
passes it over its own rail to the lane's GPUs on the rest (two rail hops for any host
count; a lane's sub-parts enter the hosts in turn, so every host's NIC forwards a share).
Every GPU holding a sub-part passes it to the destinations of its host. The source's own
lane reaches the destinations of its host through each of them in turn, so the source's
fabric out-link carries each byte once. A tree is then at most scatter, two rail hops and
an all-gather deep, whatever the destination count (the flow trees' Prim growth makes 9-11
levels for 15-31 destinations, each level a message delay and a piece of pipeline fill).

Rates are max-min fair over the trees (progressive filling on the links and device limits
they use), so the fluid schedule fits every capacity; the planner prices the trees like a
packing and keeps them when they are faster.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Sequence

from wasma.transfer.algorithms import host_gpus
from wasma.transfer.costmodel import LinkTable
from wasma.transfer.packing import FlowNetwork, Packing, Resource, Tree, TreeHop
from wasma.transfer.topology import TopologyError

# The least rate, as a share of the trees', for which a chain over the capacity they leave
# is worth its depth.
SPARE_SHARE = 0.05


class _Paths:
    """Fabric paths between GPUs, never through another GPU (a relay is a hop's end).
    Inside a host, the widest path; between hosts, out through the sender's own NIC and
    in through the receiver's (each GPU of a host takes the nearest NIC the fewest GPUs
    before it took), so lane r stays on rail r."""

    def __init__(self, table: LinkTable) -> None:
        self.table = table
        self.memo: dict[tuple[str, str], tuple[str, ...]] = {}
        self.nics: dict[str, str | None] = {}

    def __call__(self, src: str, dst: str) -> tuple[str, ...]:
        found = self.memo.get((src, dst))
        if found is None:
            found = self._route(src, dst)
            if any(self.table.topology.kind_of(n) == "gpu" for n in found[1:-1]):
                raise TopologyError(f"no path from {src} to {dst} outside other GPUs")
            self.memo[src, dst] = found
        return found

    def _route(self, src: str, dst: str) -> tuple[str, ...]:
        topology = self.table.topology
        out, into = self.nic(src), self.nic(dst)
        if topology.host_of(src) == topology.host_of(dst) or out is None or into is None:
            return self.table.path(src, dst)
        return (
            self.table.path(src, out)
            + self.table.path(out, into)[1:]
            + self.table.path(into, dst)[1:]
        )

    def nic(self, gpu: str) -> str | None:
        if gpu not in self.nics:
            topology = self.table.topology
            host = topology.host_of(gpu)
            nics = [d.name for d in topology.devices() if d.kind == "nic" and d.host == host]
            taken: Counter[str] = Counter()
            for g in host_gpus(self.table, host):
                self.nics[g] = None
                reachable = []
                for nic in nics:
                    try:
                        path = self.table.path(g, nic)
                    except TopologyError:
                        continue
                    if any(topology.kind_of(n) == "gpu" for n in path[1:-1]):
                        continue
                    latency = sum(self.table.latency(*link) for link in itertools.pairwise(path))
                    reachable.append((taken[nic], latency, nic))
                if reachable:
                    chosen = min(reachable)[2]
                    self.nics[g] = chosen
                    taken[chosen] += 1
        return self.nics[gpu]


def rail_trees(table: LinkTable, src: str, dsts: Sequence[str]) -> list[Tree] | None:
    """The lanes' trees from `src` to `dsts` (None where a lane has no path outside other
    GPUs). Where a host's switch multicasts, a GPU passes a sub-part to the others of its
    host in one multicast, and the source sends each sub-part once into its host's switch
    for all of that host's destinations and the lane's owner."""
    topology = table.topology
    home = topology.host_of(src)
    by_host: dict[str, list[str]] = {}
    for d in dsts:
        by_host.setdefault(topology.host_of(d), []).append(d)
    remote = [h for h in by_host if h != home]
    local = [d for d in by_host.get(home, []) if d != src]
    paths = _Paths(table)
    try:
        home_multicasts = len(_fans(paths, src, local)) < len(local)
    except TopologyError:
        return None
    if not remote:
        try:
            if home_multicasts:
                # One host whose switch multicasts: the source's one send reaches all.
                return [_fan_out(paths, src, local, {src: None}, [])]
            # Each destination relays a sub-part to the others (scatter + all-gather
            # over the host's fabric).
            return [
                tuple(
                    TreeHop(a, b, paths(a, b), None if a == src else 0)
                    for a, b in [(src, j), *((j, d) for d in local if d != j)]
                )
                for j in local
            ]
        except TopologyError:
            return None
    owners = host_gpus(table, home)
    landing = {h: host_gpus(table, h) for h in remote}
    lanes = min(len(owners), *(len(g) for g in landing.values()))
    if lanes < 1:
        return None
    # The source's own lane goes first: its rail starts at the source itself.
    order = sorted(range(lanes), key=lambda r: owners[r] != src)
    if src not in owners[:lanes]:
        order = list(range(lanes))
    trees: list[Tree] = []
    try:
        for r in order:
            owner = owners[r]
            # Each sub-part enters one host first, the hosts in turn, so that every
            # host's NIC r forwards its share to the rest (a chain through the hosts
            # would be as many rail hops deep as there are hosts).
            firsts = remote
            # Where the source's switch multicasts, its one send reaches the host: no relay.
            relays = [src] if home_multicasts else [owner] if owner != src else local or [src]
            for i in range(max(len(relays), len(firsts))):
                trees.append(
                    _lane_tree(
                        paths,
                        src,
                        owner,
                        relays[i % len(relays)],
                        firsts[i % len(firsts)],
                        [landing[h][r] for h in remote],
                        local,
                        by_host,
                    )
                )
    except TopologyError:
        return None
    return trees


def _fans(paths: _Paths, a: str, targets: Sequence[str]) -> list[list[str]]:
    """`targets` in groups `a` reaches in one send each: those whose paths from `a` fork
    at one switch that multicasts, right after `a`'s own link into it (each branch then
    its own links); every other target alone."""
    topology = paths.table.topology
    groups: dict[str, list[str]] = {}
    alone: list[list[str]] = []
    for b in targets:
        path = paths(a, b)
        if len(path) > 2 and topology.can_multicast(path[1]):
            groups.setdefault(path[1], []).append(b)
        else:
            alone.append([b])
    out = []
    for members in groups.values():
        branches = [tuple(itertools.pairwise(paths(a, b)[1:])) for b in members]
        links = [link for branch in branches for link in branch]
        if len(members) > 1 and len(set(links)) == len(links):
            out.append(members)
        else:
            out.extend([b] for b in members)
    return out + alone


def _fan_out(
    paths: _Paths,
    a: str,
    targets: Sequence[str],
    holder: dict[str, int | None],
    hops: list[TreeHop],
) -> Tree:
    """`hops` with `a` sending to each of `targets` (in one multicast where `_fans` groups
    them); `holder` maps each device to the hop that delivers to it."""
    for members in _fans(paths, a, [b for b in targets if b != a]):
        first = len(hops)
        for b in members:
            group = first if len(members) > 1 else None
            hops.append(TreeHop(a, b, paths(a, b), holder[a], group))
            holder[b] = len(hops) - 1
    return tuple(hops)


def _lane_tree(
    paths: _Paths,
    src: str,
    owner: str,
    relay: str,
    first: str,
    lands: list[str],
    local: list[str],
    by_host: dict[str, list[str]],
) -> Tree:
    """One sub-part's tree: src -> owner; the owner over its rail to the lane's GPU on
    host `first`, which passes it to the other hosts' lane GPUs; `relay` (the owner, or
    for the source's own lane a destination of the source host; the source itself where
    its switch multicasts) to the source host's other destinations; each lane GPU to its
    own host's destinations (in one multicast where their switch multicasts)."""
    topology = paths.table.topology
    hops: list[TreeHop] = []
    holder: dict[str, int | None] = {src: None}

    def send(a: str, b: str) -> None:
        hops.append(TreeHop(a, b, paths(a, b), holder[a]))
        holder[b] = len(hops) - 1

    if relay == src:
        # The source's multicast: the owner and the host's destinations at once.
        _fan_out(paths, src, list(dict.fromkeys([owner, *local])), holder, hops)
    elif owner != src:
        send(src, owner)
    else:
        send(src, relay)
    head = next(g for g in lands if topology.host_of(g) == first)
    send(owner, head)
    for land in lands:
        if land != head:
            send(head, land)
    if relay != src:
        for d in local:
            if d != relay:
                send(relay, d)
    for land in lands:
        _fan_out(paths, land, by_host[topology.host_of(land)], holder, hops)
    return tuple(hops)


def fair_rates(network: FlowNetwork, trees: Sequence[Tree]) -> list[float]:
    """Max-min fair rates (progressive filling): every tree's rate rises together until
    a link or device limit it uses is full, then stays; the rest go on."""
    usages = [network.usage(t) for t in trees]
    left: dict[Resource, float] = {}
    for used in usages:
        for key in used:
            if key in network.capacity:
                left[key] = network.capacity[key]
            elif isinstance(key, tuple):
                raise TopologyError(f"link {key[0]} -> {key[1]} carries nothing")
    rates = [0.0] * len(trees)
    active = set(range(len(trees)))
    while active:
        load: dict[Resource, float] = {}
        for t in active:
            for key, n in usages[t].items():
                if key in left:
                    load[key] = load.get(key, 0.0) + n
        step = min(left[key] / units for key, units in load.items())
        for t in active:
            rates[t] += step
        full = set()
        for key, units in load.items():
            left[key] -= step * units
            if left[key] <= 1e-9 * network.capacity[key]:
                full.add(key)
        active = {t for t in active if not any(key in full for key in usages[t])}
    return rates


def spare_chain(
    network: FlowNetwork, src: str, dsts: Sequence[str], left: dict[Resource, float]
) -> tuple[Tree, float] | None:
    """A chain from `src` through every destination over what `left` (capacity per link
    and device limit) still has, each next destination the one behind the widest path
    (never through another GPU), and the chain's rate; None where some destination is
    out of its reach. On an HGX host the trees fill NVLink and leave PCIe: a chain is the
    only broadcast PCIe switches carry at their full rate (they cannot duplicate)."""
    hops: list[TreeHop] = []
    here = src
    todo = [d for d in dict.fromkeys(dsts) if d != src]
    used: Counter[Resource] = Counter()
    while todo:
        best = widest_next(network, here, todo, left)
        if best is None:
            return None
        d, path = best
        hops.append(TreeHop(here, d, path, len(hops) - 1 if hops else None))
        used.update(itertools.pairwise(path))
        used.update(n for n in path[1:-1] if n in network.capacity)
        here = d
        todo.remove(d)
    tree = tuple(hops)
    return tree, min(left[key] / n for key, n in used.items())


def widest_next(
    network: FlowNetwork, src: str, todo: Sequence[str], left: dict[Resource, float]
) -> tuple[str, tuple[str, ...]] | None:
    """The one of `todo` behind the widest path from `src` under `left` (the first in
    `todo` order among equals), and that path; None where no path has room."""
    best: tuple[float, str, tuple[str, ...]] | None = None
    for d in todo:
        found = widest_path(network, src, d, left)
        if found is not None and (best is None or found[0] > best[0]):
            best = (found[0], d, found[1])
    if best is None or not best[0] > 0:
        return None
    return best[1], best[2]


def widest_path(
    network: FlowNetwork, src: str, dst: str, left: dict[Resource, float]
) -> tuple[float, tuple[str, ...]] | None:
    """The widest path under `left` from src to dst through non-GPU devices."""
    width = {src: math.inf}
    previous: dict[str, str] = {}
    heap = [(-math.inf, src)]
    done: set[str] = set()
    while heap:
        w, node = heapq.heappop(heap)
        if node in done:
            continue
        done.add(node)
        if node == dst:
            break
        if node != src and network.is_gpu[node]:
            continue
        for nxt in network.adjacent[node]:
            room = min(-w, left.get((node, nxt), 0.0))
            if not network.is_gpu[nxt] and nxt in network.capacity:
                room = min(room, left.get(nxt, 0.0))
            if room > width.get(nxt, 0.0) and nxt not in done:
                width[nxt] = room
                previous[nxt] = node
                heapq.heappush(heap, (-room, nxt))
    if dst not in done:
        return None
    path = [dst]
    while path[-1] != src:
        path.append(previous[path[-1]])
    return width[dst], tuple(reversed(path))


def rail_packing(
    table: LinkTable, network: FlowNetwork, src: str, dsts: Sequence[str]
) -> Packing | None:
    """The lanes' trees at their fair rates, and a chain over the capacity they leave
    (where it carries at least `SPARE_SHARE` of their rate), as a packing."""
    trees = rail_trees(table, src, dsts)
    if not trees:
        return None
    try:
        rates = fair_rates(network, trees)
    except TopologyError:
        return None
    kept = [(t, r) for t, r in zip(trees, rates, strict=True) if r > 0]
    if not kept:
        return None
    left = network.left_after((network.usage(t), r) for t, r in kept)
    chain = spare_chain(network, src, dsts, left)
    if chain is not None and chain[1] >= SPARE_SHARE * sum(r for _, r in kept):
        kept.append(chain)
    total = sum(r for _, r in kept)
    return Packing(tuple(kept), total, total, 0)
