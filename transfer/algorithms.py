"""Candidate plan builders. Each returns hops; the planner prices them all with the same
`LinkTable` and keeps the fastest.

Pipelined plans (every hop cut into the same number of pieces k, each hop forwarding its
parent's range) have a closed form: a piece leaves hop h after the pieces before it, so the
last piece reaches the end of a root-to-leaf route after sum(t_h + d_h) + (k - 1) * max(t_h),
t_h = o_h + bytes_h / (k * beta_h) the time a piece holds hop h's path, d_h its delay to
landing (latency). `best_chunks` minimises that over k at once.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import networkx as nx
import numpy as np

from wasma.transfer.costmodel import HopCost, LinkTable
from wasma.transfer.plan import Hop

# Bytes used to rank "near" destinations: big enough that bandwidth matters, small enough
# that latency still breaks ties between equally wide paths.
_RANKING_BYTES = 1 << 20


def distance_s(table: LinkTable, src: str, dst: str) -> float:
    path = table.path(src, dst)
    links = list(itertools.pairwise(path))
    width = min(table.bandwidth(*link) for link in links)
    return sum(table.latency(*link) for link in links) + _RANKING_BYTES / width


def nearest_order(table: LinkTable, src: str, dsts: Sequence[str]) -> list[str]:
    """Greedy nearest-neighbour tour from src: keeps a host's GPUs together in a chain."""
    order: list[str] = []
    left = list(dsts)
    here = src
    while left:
        nxt = min(left, key=lambda d: (distance_s(table, here, d), d))
        order.append(nxt)
        left.remove(nxt)
        here = nxt
    return order


class _Router:
    """Picks each hop's path knowing the links earlier hops of the same plan (and round)
    occupy, so concurrent hops spread over parallel links instead of queueing on one."""

    def __init__(self, table: LinkTable) -> None:
        self.table = table
        self.busy: dict[int, Counter[tuple[str, str]]] = {}

    def hop(
        self,
        src: str,
        dst: str,
        offset: int,
        length: int,
        after: int | None = None,
        stage: int = 0,
    ) -> Hop:
        busy = self.busy.setdefault(stage, Counter())
        path = self.table.path(src, dst, busy)
        busy.update(itertools.pairwise(path))
        return Hop(src, dst, path, offset, length, 1, after, stage)


def with_chunks(hops: Sequence[Hop], chunks: int) -> list[Hop]:
    return [replace(h, chunks=max(1, min(chunks, h.num_bytes or 1))) for h in hops]


def best_chunks(table: LinkTable, hops: Sequence[Hop], max_chunks: int) -> int:
    """Piece count minimising a pipelined plan's completion time (closed form over k)."""
    if not hops:
        return 1
    costs = table.hop_costs(hops)
    ks = np.arange(1, max(1, max_chunks) + 1, dtype=float)
    occupy = np.array([c.occupy_s for c in costs])[:, None]
    delay = np.array([c.delay_s for c in costs])[:, None]
    beta = np.array([c.bandwidth_Bps for c in costs])[:, None]
    nbytes = np.array([float(h.num_bytes) for h in hops])[:, None]
    piece = occupy + nbytes / (ks[None, :] * beta)  # time a piece holds hop h's path
    # Route sums/maxes accumulate down the tree; hops list parents first.
    route_sum = np.empty_like(piece)
    route_max = np.empty_like(piece)
    for i, hop in enumerate(hops):
        if hop.after is None:
            route_sum[i], route_max[i] = piece[i] + delay[i], piece[i]
        else:
            route_sum[i] = route_sum[hop.after] + piece[i] + delay[i]
            route_max[i] = np.maximum(route_max[hop.after], piece[i])
    total = (route_sum + (ks[None, :] - 1) * route_max).max(axis=0)
    return int(ks[int(np.argmin(total))])


def chunks_per_tree(table: LinkTable, hops: Sequence[Hop], max_chunks: int) -> list[Hop]:
    """Each tree (a root hop and the hops forwarding it) cut into its own best piece
    count: trees at fixed rates do not wait on one another, so a one-hop path need not pay
    the per-piece cost a deep one needs to pipeline."""
    out = list(hops)
    for members in trees_of(hops).values():
        position = {old: new for new, old in enumerate(members)}
        local = [_renumbered(hops[i], position) for i in members]
        chunks = best_chunks(table, local, max_chunks)
        for i in members:
            out[i] = replace(hops[i], chunks=max(1, min(chunks, hops[i].num_bytes or 1)))
    return out


def trees_of(hops: Sequence[Hop]) -> dict[int, list[int]]:
    """Hop indices per tree (a root hop, the hops of its multicast and the hops
    forwarding them), keyed by the root."""
    trees: dict[int, list[int]] = {}
    root: dict[int, int] = {}
    for index, hop in enumerate(hops):
        parent = hop.after
        if hop.multicast is not None and hop.multicast != index:
            root[index] = root[hop.multicast]  # a multicast's hops are in one tree
        else:
            root[index] = index if parent is None else root[parent]
        trees.setdefault(root[index], []).append(index)
    return trees


# Tapered pieces (`Hop.taper`, `Hop.ramp`). Hops within MIN_RAMP of a route's bottleneck
# rate count as running at it; ramps are tried up to MAX_RAMP. The smallest end piece
# stays at least 1 / MAX_SHRINK of a middle one and MIN_END_BYTES long, and at most
# MAX_TAPER pieces taper at each end; at most MAX_RAMPS ramps are priced per tree.
MIN_RAMP = 1.02
MAX_RAMP = 2.0
MAX_SHRINK = 16.0
MIN_END_BYTES = 4096
MAX_TAPER = 32
MAX_RAMPS = 4
KEEP_PIECES = (0.6, 0.7, 0.8, 0.9, 1.0)  # shares of a tree's piece count tried


@dataclass(frozen=True)
class _Route:
    """One root-to-leaf route of a tree, as `tree_taper` prices it."""

    size: float  # bytes
    const: float  # bytes over the bottleneck rate, plus every hop's fixed costs
    up: float  # sum of 1 / rate over the faster hops before the bottleneck's
    up_gap: float  # 1 / bottleneck rate - 1 / the slowest of those
    down: float  # the same after the bottleneck's hops
    down_gap: float
    middle: float  # per middle-piece byte: hops between two at the bottleneck's rate


def _route(rates: Sequence[float], size: float, const: float) -> _Route:
    slowest = min(rates)
    slow = [n for n, r in enumerate(rates) if r <= slowest * MIN_RAMP]
    up = rates[: slow[0]]
    down = rates[slow[-1] + 1 :]
    inner = [r for n, r in enumerate(rates) if slow[0] < n < slow[-1] and n not in slow]
    return _Route(
        size,
        const,
        sum(1.0 / r for r in up),
        1.0 / slowest - 1.0 / min(up) if up else 0.0,
        sum(1.0 / r for r in down),
        1.0 / slowest - 1.0 / min(down) if down else 0.0,
        (len(slow) - 1) / slowest + sum(1.0 / r for r in inner),
    )


def _end_fill(shrink: np.ndarray, ramp: float, width: np.ndarray, gap: np.ndarray) -> np.ndarray:
    """Per (taper, route), over a middle piece's bytes: the longest path's cost at one end,
    max over j of m_j * width - gap * (m_0 + ... + m_{j-1}) with m_j = ramp^-(s - j)
    for j <= s. That is r^-s * (r^j * (width - gap / (r - 1)) + gap / (r - 1)), monotone
    in j, so the larger of j = 0 (the end piece crosses) and j = s (a middle one does)."""
    s = shrink[:, None]  # ramp^-taper
    fill: np.ndarray = np.maximum(s * width, width - gap * (1 - s) / (ramp - 1))
    return fill


def tree_taper(
    hops: Sequence[Hop], costs: Sequence[HopCost], members: Sequence[int]
) -> tuple[int, float, int, float] | None:
    """(taper, ramp, chunks, seconds gained) for one pipelined tree, in closed form; None
    when equal pieces are as good.

    A route's last piece lands after the longest path through the grid of (hop, piece)
    cells, each cell a piece's time on a hop (o + m / beta_h), plus its delays. With equal
    pieces of m bytes that is N / b + m * (sum of 1 / beta_h over the hops but the
    bottleneck) + fixed costs: the faster hops cost a whole piece each (the fill). With
    pieces m_0 <= m_1 <= ... growing from the front, the path may cross the hops before
    the bottleneck (U = the sum of their 1 / beta_h) on piece j, having carried the
    pieces before j on the slowest of them, g = 1 / b - 1 / beta_slowest per byte less
    than the bottleneck takes: max over j of m_j * U - g * (m_0 + ... + m_{j-1}). The same
    holds for the tail after the bottleneck; hops between two at the bottleneck's rate
    pay a middle piece. Growth by ramp = 1 + g / U keeps that max at j = 0 (the end
    piece): that is the ramp tried for each side of each route (at most MAX_RAMPS). With
    m_mid = N / W, W = k - 2 * taper + 2 * sum(ramp^-i, i = 1..taper), the tree's slowest
    route is minimised over k (a few counts up to the tree's own) and taper at once,
    against equal pieces at the tree's own count."""
    first = hops[members[0]]
    if len(members) < 2 or first.chunks < 3:
        return None
    if any(hops[i].stage != first.stage for i in members):
        return None
    has_child = {hops[i].after for i in members}
    routes: set[_Route] = set()
    for leaf in (i for i in members if i not in has_child):
        route = [leaf]
        while (parent := hops[route[-1]].after) is not None:
            route.append(parent)
        route.reverse()
        rates = [costs[i].bandwidth_Bps for i in route]
        size = float(min(hops[i].num_bytes for i in route))
        routes.add(_route(rates, size, size / min(rates) + sum(costs[i].alpha_s for i in route)))
    ramps = sorted(
        {
            round(min(MAX_RAMP, 1.0 + gap / width) * 1000) / 1000  # readable; weights exact
            for r in routes
            for width, gap in ((r.up, r.up_gap), (r.down, r.down_gap))
            if width > 0 and gap / width >= MIN_RAMP - 1.0
        }
    )
    if not ramps:
        return None
    if len(ramps) > MAX_RAMPS:
        ramps = [ramps[round(i * (len(ramps) - 1) / (MAX_RAMPS - 1))] for i in range(MAX_RAMPS)]
    columns = np.array([[getattr(r, f) for r in routes] for f in _Route.__dataclass_fields__])
    size, const, up, up_gap, down, down_gap, middle = columns[:, None, None, :]
    occupy = max(costs[i].occupy_s for i in members)
    k0 = first.chunks
    # Piece counts tried: the tree's own and down to 60% of it (tapered pieces need less
    # pipelining), a handful rather than every count, as the planner runs at decision time.
    ks = np.unique(np.maximum(3, np.round(k0 * np.array(KEEP_PIECES))))[:, None]
    equal = (const + size / k0 * (up + down + middle)).max() + k0 * occupy
    best: tuple[float, int, float, int] | None = None
    for ramp in ramps:
        most = min(MAX_TAPER, int(math.log(MAX_SHRINK) / math.log(ramp)), (k0 - 1) // 2)
        if most < 1:
            continue
        steps = np.arange(most + 1, dtype=float)
        shrink = ramp**-steps
        fills = (
            _end_fill(shrink, ramp, up[0], up_gap[0])
            + _end_fill(shrink, ramp, down[0], down_gap[0])
            + middle[0]
        )  # (s, route)
        weight = ks - 2 * steps + 2 * np.concatenate(([0.0], np.cumsum(shrink[1:])))
        mid = size / weight[..., None]  # (k, s, route)
        land = (const + mid * fills[None]).max(axis=2) + ks * occupy  # (k, s)
        end = mid.min(axis=2) * shrink
        land[(2 * steps[None, :] + 1 > ks) | (end < MIN_END_BYTES)] = np.inf
        land[:, 0] = np.inf  # equal pieces: `equal` above
        k_at, taper = np.unravel_index(int(np.argmin(land)), land.shape)
        if best is None or land[k_at, taper] < best[0]:
            best = (float(land[k_at, taper]), int(taper), ramp, int(ks[k_at, 0]))
    if best is None or not best[0] < equal:
        return None
    return best[1], best[2], best[3], equal - best[0]


def taper_trees(table: LinkTable, hops: Sequence[Hop]) -> tuple[list[Hop], list[float]] | None:
    """`hops` (already in their piece counts) with each tree that the closed form says
    gains from it cut into tapered pieces (`tree_taper`), and per hop the seconds its tree
    is expected to gain; None when no tree gains."""
    if all(h.chunks < 3 for h in hops):
        return None  # nothing to taper: a small transfer's few pieces
    costs = table.hop_costs(hops)
    out = list(hops)
    gains = [0.0] * len(hops)
    for members in trees_of(hops).values():
        shape = tree_taper(hops, costs, members)
        if shape is None:
            continue
        taper, ramp, chunks, gain = shape
        for i in members:
            out[i] = replace(
                hops[i], chunks=max(1, min(chunks, hops[i].num_bytes or 1)), taper=taper, ramp=ramp
            )
            gains[i] = gain
    return (out, gains) if any(gains) else None


def _renumbered(hop: Hop, position: dict[int, int]) -> Hop:
    parent, group = hop.after, hop.multicast
    return replace(
        hop,
        after=None if parent is None else position[parent],
        multicast=None if group is None else position[group],
    )


# builders ------------------------------------------------------------------------------
def direct(table: LinkTable, src: str, dsts: Sequence[str], num_bytes: int) -> list[Hop]:
    """The source sends the whole range to every destination at once."""
    router = _Router(table)
    return [router.hop(src, d, 0, num_bytes) for d in dsts]


def straight(table: LinkTable, parts: Sequence[tuple[str, str, int, int]]) -> list[Hop]:
    """Each part (sender, receiver, offset, length) in one hop, the paths spread over
    parallel links."""
    router = _Router(table)
    return [router.hop(src, dst, offset, length) for src, dst, offset, length in parts]


def chain(table: LinkTable, src: str, dsts: Sequence[str], num_bytes: int) -> list[Hop]:
    """src -> d1 -> d2 -> ..., nearest first; pieces are forwarded as they arrive."""
    router = _Router(table)
    hops: list[Hop] = []
    here = src
    for dst in nearest_order(table, src, dsts):
        hops.append(router.hop(here, dst, 0, num_bytes, after=len(hops) - 1 if hops else None))
        here = dst
    return hops


def binomial_tree(table: LinkTable, src: str, dsts: Sequence[str], num_bytes: int) -> list[Hop]:
    """Each round, every holder sends the whole range to its nearest new destination."""
    router = _Router(table)
    left = nearest_order(table, src, dsts)
    holders: list[tuple[str, int | None]] = [(src, None)]
    hops: list[Hop] = []
    stage = 0
    while left:
        new_holders = []
        for holder, got_by in holders:
            if not left:
                break
            dst = min(left, key=lambda d, h=holder: (distance_s(table, h, d), d))  # type: ignore[misc]
            left.remove(dst)
            hops.append(router.hop(holder, dst, 0, num_bytes, after=got_by, stage=stage))
            new_holders.append((dst, len(hops) - 1))
        holders += new_holders
        stage += 1
    return hops


def packed_trees(table: LinkTable, src: str, dsts: Sequence[str], num_bytes: int) -> list[Hop]:
    """One depth-2 tree per destination d_j: src sends part j to d_j, which passes it to
    all others. Every destination's out-link works, so a switch's bandwidth is used from
    both sides (scatter + all-gather broadcast)."""
    n = len(dsts)
    bounds = [(j * num_bytes // n, (j + 1) * num_bytes // n) for j in range(n)]
    router = _Router(table)
    hops = [router.hop(src, d, lo, hi - lo) for d, (lo, hi) in zip(dsts, bounds, strict=True)]
    for j, (owner, (lo, hi)) in enumerate(zip(dsts, bounds, strict=True)):
        hops.extend(
            router.hop(owner, other, lo, hi - lo, after=j) for other in dsts if other != owner
        )
    return hops


def hierarchical(
    table: LinkTable, src: str, dsts: Sequence[str], num_bytes: int, *, leaders_in_chain: bool
) -> list[Hop]:
    """One inter-node hop per remote host (to the destination nearest the source), then
    a pipelined chain inside each host over NVLink. Leaders get the data straight from
    the source, or (`leaders_in_chain`) along a chain of leaders."""
    topology = table.topology
    src_host = topology.host_of(src)
    by_host: dict[str, list[str]] = {}
    for d in dsts:
        by_host.setdefault(topology.host_of(d), []).append(d)
    hops: list[Hop] = []
    router = _Router(table)

    def fan_out(root: str, root_hop: int | None, members: list[str]) -> None:
        here, after = root, root_hop
        for dst in nearest_order(table, root, members):
            hops.append(router.hop(here, dst, 0, num_bytes, after=after))
            here, after = dst, len(hops) - 1

    remote = [h for h in by_host if h != src_host]
    leaders = {h: min(by_host[h], key=lambda d: (distance_s(table, src, d), d)) for h in remote}
    here, after = src, None
    for leader in nearest_order(table, src, list(leaders.values())):
        sender, sender_hop = (here, after) if leaders_in_chain else (src, None)
        hops.append(router.hop(sender, leader, 0, num_bytes, after=sender_hop))
        here, after = leader, len(hops) - 1
        host = topology.host_of(leader)
        fan_out(leader, after, [d for d in by_host[host] if d != leader])
    if src_host in by_host:
        fan_out(src, None, by_host[src_host])
    return hops


def stripes(table: LinkTable, src: str, dst: str, num_bytes: int, max_paths: int = 4) -> list[Hop]:
    """Split one transfer over several paths, bytes in proportion to each path's share
    of the max flow (then evened out so all stripes finish together)."""
    paths = flow_paths(table, src, dst, max_paths)
    if len(paths) < 2:
        return []
    hops = [Hop(src, dst, p, 0, 0) for p in paths]
    costs = table.hop_costs(hops)
    # Equal finish: bytes_i = beta_i * (T - alpha_i), sum bytes_i = num_bytes.
    live = list(range(len(hops)))
    while True:
        total_beta = sum(costs[i].bandwidth_Bps for i in live)
        finish = (
            num_bytes + sum(costs[i].bandwidth_Bps * costs[i].alpha_s for i in live)
        ) / total_beta
        slow = [i for i in live if costs[i].alpha_s >= finish]
        if not slow or len(live) == 1:
            break
        live = [i for i in live if i not in slow]
    if len(live) < 2:
        return []
    shares = [costs[i].bandwidth_Bps * max(0.0, finish - costs[i].alpha_s) for i in live]
    scale = num_bytes / sum(shares)
    out: list[Hop] = []
    offset = 0
    for n, (i, share) in enumerate(zip(live, shares, strict=True)):
        length = num_bytes - offset if n == len(live) - 1 else int(share * scale)
        out.append(replace(hops[i], offset_bytes=offset, num_bytes=length))
        offset += length
    return [h for h in out if h.num_bytes > 0]


def rail_stripes(table: LinkTable, src: str, dst: str, num_bytes: int) -> list[Hop]:
    """Stripe a move between hosts over every rail (PXN-style): part r goes over NVLink
    to the source host's GPU r, out through that GPU's own NIC to GPU r on the destination
    host, and over NVLink into dst. With one NIC per GPU, all NICs carry the transfer."""
    topology = table.topology
    src_host, dst_host = topology.host_of(src), topology.host_of(dst)
    if src_host == dst_host:
        return []
    src_side = host_gpus(table, src_host)
    dst_side = host_gpus(table, dst_host)
    rails = list(zip(src_side, dst_side, strict=False))
    if len(rails) < 2:
        return []
    hops: list[Hop] = []
    router = _Router(table)
    for r, (near, far) in enumerate(rails):
        lo, hi = r * num_bytes // len(rails), (r + 1) * num_bytes // len(rails)
        after = None
        if near != src:
            hops.append(router.hop(src, near, lo, hi - lo))
            after = len(hops) - 1
        hops.append(router.hop(near, far, lo, hi - lo, after=after))
        if far != dst:
            hops.append(router.hop(far, dst, lo, hi - lo, after=len(hops) - 1))
    return hops


def host_gpus(table: LinkTable, host: str) -> list[str]:
    """A host's GPUs in rail order: GPU i pairs with GPU i of the other hosts
    (rail-optimised fabrics wire NIC i of every node to the same leaf)."""
    gpus = [g for g in table.topology.gpus() if table.topology.host_of(g) == host]
    return sorted(gpus, key=lambda g: (len(g), g))


def flow_paths(table: LinkTable, src: str, dst: str, max_paths: int) -> list[tuple[str, ...]]:
    """Decompose a max flow from src to dst (GPUs only as endpoints) into paths, widest
    first (memoised by the table until a link changes)."""
    return table.flows(src, dst, max_paths, lambda: _flow_paths(table, src, dst, max_paths))


def _flow_paths(table: LinkTable, src: str, dst: str, max_paths: int) -> list[tuple[str, ...]]:
    graph = nx.DiGraph()
    topology = table.topology
    for link in topology.links():
        for a, b in ((link.u, link.v), (link.v, link.u)):  # capacities from the live table
            if table.is_down(a, b) or b == src or a == dst:
                continue
            if (topology.kind_of(a) == "gpu" and a != src) or (
                topology.kind_of(b) == "gpu" and b != dst
            ):
                continue
            graph.add_edge(a, b, capacity=table.bandwidth(a, b))
    if src not in graph or dst not in graph:
        return []
    _, flow = nx.maximum_flow(graph, src, dst)
    paths: list[tuple[tuple[str, ...], float]] = []
    while len(paths) < max_paths:
        path = [src]
        seen = {src}
        while path[-1] != dst:
            step = max(flow[path[-1]].items(), key=lambda kv: kv[1], default=(None, 0.0))
            if step[0] is None or step[1] <= 0 or step[0] in seen:
                break
            path.append(step[0])
            seen.add(step[0])
        if path[-1] != dst:
            break
        amount = min(flow[a][b] for a, b in itertools.pairwise(path))
        for a, b in itertools.pairwise(path):
            flow[a][b] -= amount
        paths.append((tuple(path), amount))
    if not paths:
        return []
    top = paths[0][1]
    # Stripes that would carry a sliver cost a message each and gain nothing.
    return [p for p, amount in paths if amount >= 0.05 * top]
