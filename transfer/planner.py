"""The transfer planner: builds candidate plans, prices them under the alpha-beta model
with link sharing, keeps the fastest, and learns link speeds from measured transfers."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, replace

from wasma.transfer import algorithms as alg
from wasma.transfer.chains import disjoint_chain, paired_chains
from wasma.transfer.costmodel import LinkTable
from wasma.transfer.flows import (
    Demand,
    DemandFlow,
    FlowSchedule,
    gather_demands,
    scatter_demands,
    schedule_hops,
)
from wasma.transfer.packing import (
    FlowNetwork,
    Packing,
    bound_from_cuts,
    latency_floor_s,
    work_conserving,
)
from wasma.transfer.plan import Hop, Span, TransferPlan, own_links
from wasma.transfer.rails import fair_rates, rail_packing
from wasma.transfer.symmetry import pair_classes
from wasma.transfer.topology import Topology, TopologyError

ALGORITHMS = (
    "direct",
    "stripe",
    "rail_stripe",
    "chain",
    "binomial_tree",
    "packed_trees",
    "hierarchical",
    "hierarchical_chain",
    "flow_trees",
    "rail_trees",
    "disjoint_chain",
    "paired_chains",
)
PIPELINED = frozenset(
    {"chain", "rail_stripe", "packed_trees", "hierarchical", "hierarchical_chain", "flow_trees"}
)
# Pieces summed over a plan's hops that pricing simulates at most: a packing of many
# trees gets fewer pieces per hop, so planning it stays a few milliseconds.
MAX_PIECES = 65536
# Link-table states whose octave prices `estimate_s` keeps (the idle table and a few
# with transfers reserved).
MEMO_STATES = 8
# An octave's price: (its low end in bytes, seconds there, seconds per byte above it).
Octave = tuple[float, float, float]
# A preset's GPU names, whose host index the symmetry memo of `estimate_s` drops.
_PRESET_GPU = re.compile(r"n(\d+)\.gpu(\d+)")
# Re-weightings of a gather's or scatter's flow tried after the plain one (each is a few
# max flows and one pricing).
REWEIGHT_ROUNDS = 3
# Packed trees need n^2 hops; past this many destinations they cost more to price than
# they can gain over a chain.
MAX_PACKED_DESTINATIONS = 16


# The max-flow rate of the worst destination, and (capacity, latency after) of the cuts
# the bound is taken over.
_Bound = tuple[float, tuple[tuple[float, float], ...]]


@dataclass(slots=True)
class _StateCaches:
    """What `Planner` computed at one link-table state."""

    network: FlowNetwork | None
    packings: dict[tuple[tuple[str, ...], frozenset[str]], Packing | None]
    bounds: dict[tuple[tuple[str, ...], frozenset[str]], _Bound]
    plans: dict[tuple[object, ...], TransferPlan]


class Planner:
    """Plans moves of `num_bytes` from one device (or several holding the same bytes) to
    others on a `Topology`, and says how close each plan is to the max-flow bound.

    `flow_trees` packs broadcast trees to reach the bound on any topology; the shape
    algorithms (chains, trees, stripes) are kept as candidates, as they win where a
    transfer is small and latency, not bandwidth, decides. Plans are memoised per
    (holders, destinations, size, algorithms) until a link changes; `estimate_s` is the
    router's price: memoised per (source, destination set, size octave) and interpolated
    inside the octave, so a repeat call is a dict lookup.
    """

    def __init__(
        self,
        topology: Topology,
        *,
        per_message_s: float = 5e-6,
        per_hop_s: float = 0.0,
        max_chunks: int = 256,
        ewma_weight: float = 0.3,
        algorithms: Iterable[str] | None = None,
        message_window: int = 16,
        by_symmetry: bool = True,
    ) -> None:
        if not 0 < ewma_weight <= 1:
            raise ValueError("ewma_weight must be in (0, 1]")
        if max_chunks < 1:
            raise ValueError("max_chunks must be >= 1")
        self.topology = topology
        self.links = LinkTable(topology, per_message_s, per_hop_s, message_window)
        self.max_chunks = max_chunks
        self.ewma_weight = ewma_weight
        self.algorithms = self._check_algorithms(algorithms or ALGORITHMS)
        self.plans_computed = 0  # how often a plan was built (memoisation shows here)
        # Octave prices per link-table state (`LinkTable.state`), the few most recent
        # states kept: reservations come and go with every transfer, and prices made at
        # an idle table stay good for the next idle moment.
        self._memos: dict[Hashable, dict[tuple[str, str | frozenset[str], int], Octave]] = {}
        # On hosts wired alike and a link table still as built (no load, no learned
        # speed), one GPU pair's octave price stands for every pair of its class.
        self.by_symmetry = by_symmetry and topology.hosts_alike
        self._class_memo: dict[tuple[bool, str, str, int], Octave] = {}
        # GPU index pairs of one host -> the first pair of their class under the preset's
        # automorphisms (transfer/symmetry.py), found on the first price asked for.
        self._host_pairs: dict[tuple[str, str], tuple[str, str]] | None = None
        # Per link-table state (the few most recent): the flow network, packings and
        # bounds per (holders, destinations), and finished plans per request. Keyed by
        # state, not version, so a reservation made and released keeps them.
        self._cache_version = -1
        self._cache_state: Hashable = None
        self._saved: dict[Hashable, _StateCaches] = {}
        self._network: FlowNetwork | None = None
        self._packings: dict[tuple[tuple[str, ...], frozenset[str]], Packing | None] = {}
        self._bounds: dict[tuple[tuple[str, ...], frozenset[str]], _Bound] = {}
        self._plans: dict[tuple[object, ...], TransferPlan] = {}

    # planning ----------------------------------------------------------------------------
    def plan(
        self,
        src: str,
        dsts: Sequence[str] | str,
        num_bytes: int,
        *,
        algorithms: Iterable[str] | None = None,
    ) -> TransferPlan:
        """The fastest candidate plan under the current link model, with its bound."""
        return self.plan_from([src], dsts, num_bytes, algorithms=algorithms)

    def plan_from(
        self,
        holders: Sequence[str],
        dsts: Sequence[str] | str,
        num_bytes: int,
        *,
        algorithms: Iterable[str] | None = None,
    ) -> TransferPlan:
        """The fastest plan when every device in `holders` has the bytes: one holder
        sending a shape (chain, tree, stripe), or trees fed from all of them at once."""
        if isinstance(holders, str) or not holders:
            raise TopologyError("no holder given")
        sources = tuple(dict.fromkeys(holders))
        names = self._check_algorithms(algorithms) if algorithms is not None else self.algorithms
        self._refresh()
        key = (sources, tuple([dsts] if isinstance(dsts, str) else dsts), num_bytes, names)
        found = self._plans.get(key)
        if found is not None:
            return found
        targets = [dsts] if isinstance(dsts, str) else list(dsts)
        targets = [d for d in targets if d not in sources]
        plans = (
            [
                p
                for h in sources
                for p in self.candidates(
                    h, targets, num_bytes, algorithms=[n for n in names if n != "flow_trees"]
                )
            ]
            if any(n != "flow_trees" for n in names)
            else []
        )
        if "flow_trees" in names:
            self._check_request(sources[0], targets, num_bytes)
            for h in sources:
                self.topology.require(h, "gpu")
            plans.extend(self._flow_plans(sources, tuple(dict.fromkeys(targets)), num_bytes))
        if not plans:
            raise TopologyError(
                f"no algorithm among {', '.join(names)} applies to "
                f"{', '.join(sources)} -> {', '.join(targets)}"
            )
        best = min(plans, key=lambda p: (p.predicted_s, len(p.hops)))
        best = replace(best, holders=sources, bound_s=self.bound_s(sources, best.dsts, num_bytes))
        self._plans[key] = best
        return best

    def plan_scatter(self, src: str, wanted: Sequence[Span], num_bytes: int) -> TransferPlan:
        """Send each destination its own part of `num_bytes` that `src` holds (parts may
        not overlap: bytes two destinations want are a broadcast)."""
        self._refresh()
        key = ("scatter", src, tuple(wanted), num_bytes)
        found = self._plans.get(key)
        if found is not None:
            return found
        self._check_request(src, [s.device for s in wanted], num_bytes)
        spans = self._check_spans(wanted, num_bytes)
        ordered = sorted(spans, key=lambda s: s.offset_bytes)
        if any(a.end > b.offset_bytes for a, b in itertools.pairwise(ordered)):
            raise ValueError("scatter parts overlap: send bytes several devices want by plan()")
        targets = tuple(s for s in spans if s.device != src and s.num_bytes)
        dsts = tuple(dict.fromkeys(s.device for s in targets))
        base = TransferPlan("noop", src, dsts, num_bytes, 0.0, (), holders=(src,), wanted=targets)
        plan = self._plan_parts(base, scatter_demands(src, targets))
        self._plans[key] = plan
        return plan

    def plan_gather(self, held: Sequence[Span], dst: str, num_bytes: int) -> TransferPlan:
        """Bring every byte of `num_bytes` to `dst` from the devices holding its parts
        (a part held by several may come from any of them; `dst` may hold some)."""
        self._refresh()
        key = ("gather", dst, tuple(held), num_bytes)
        found = self._plans.get(key)
        if found is not None:
            return found
        spans = self._check_spans(held, num_bytes)
        if not spans:
            raise ValueError("a gather needs at least one held part")
        self._check_request(spans[0].device, [dst, *(s.device for s in spans)], num_bytes)
        covered = 0
        for span in sorted(spans, key=lambda s: s.offset_bytes):
            if span.offset_bytes > covered:
                break
            covered = max(covered, span.end)
        if covered < num_bytes:
            raise ValueError(f"no device holds bytes [{covered}, ...) of {num_bytes}")
        holders = tuple(dict.fromkeys(s.device for s in spans if s.device != dst)) or (dst,)
        base = TransferPlan("noop", holders[0], (dst,), num_bytes, 0.0, (), holders=holders)
        base = replace(base, held=spans)
        plan = self._plan_parts(base, gather_demands(spans, dst, num_bytes))
        self._plans[key] = plan
        return plan

    def _plan_parts(self, base: TransferPlan, demands: Sequence[Demand]) -> TransferPlan:
        """The fastest of: the flow at the bound, the flow re-weighted so deep paths
        finish with shallow ones, and each part sent straight; with the bound."""
        if not demands:
            return replace(base, bound_s=0.0)
        network = self._flow_network()
        flow = DemandFlow(network, demands)
        schedule = flow.schedule()
        if schedule is None:
            raise TopologyError(f"no working path for every part to {', '.join(base.dsts)}")
        self.plans_computed += 1
        floors = {
            (d.senders, d.dst): latency_floor_s(self.links, d.senders, [d.dst]) for d in demands
        }
        alone = max(
            sum(d.num_bytes for d in group) / flow.alone_Bps(g)
            + floors[group[0].senders, group[0].dst]
            for g, group in enumerate(flow.groups)
        )
        bound = max(schedule.seconds + min(floors.values()), alone)
        parts = [
            (min(d.senders, key=lambda s: self._near(s, d.dst)), d.dst, d.offset_bytes, d.num_bytes)
            for d in demands
        ]
        straight = alg.straight(self.links, parts)
        plans = [replace(base, algorithm="direct", predicted_s=self.links.evaluate(straight))]
        plans[0] = replace(plans[0], hops=tuple(straight), chunks=1)
        weighted: DemandFlow | None = flow
        current: FlowSchedule | None = schedule
        for _ in range(REWEIGHT_ROUNDS + 1):
            if weighted is None or current is None:
                break
            hops, owner = schedule_hops(weighted, current)
            hops = alg.chunks_per_tree(self.links, hops, self._piece_cap(len(hops)))
            finish = self.links.finish_times(hops)
            plans.append(
                replace(
                    base,
                    algorithm="flow_paths",
                    predicted_s=max(finish),
                    hops=tuple(hops),
                    chunks=max(h.chunks for h in hops),
                )
            )
            # A group's overhead is its finish past its fluid time (bytes over its rate):
            # pipeline fill and message delays, more on deep paths. Asking each group for
            # rate in proportion to 1 / (fluid + spare) lets the deep ones take more of a
            # bottleneck they share with shallow ones, so all finish together.
            ends = [0.0] * len(weighted.groups)
            rates = [0.0] * len(weighted.groups)
            for index, g in enumerate(owner):
                ends[g] = max(ends[g], finish[index])
            for g, _devices, rate in current.paths:
                rates[g] += rate
            sizes = [sum(d.num_bytes for d in group) for group in weighted.groups]
            over = [max(0.0, e - b / r) for e, b, r in zip(ends, sizes, rates, strict=True)]
            if max(over) - min(over) <= 1e-3 * max(finish):
                break
            fluid = schedule.seconds
            weights = [
                w * (fluid + max(over) - min(over)) / (fluid + max(over) - o)
                for w, o in zip(weighted.weights, over, strict=True)
            ]
            weighted = DemandFlow(network, demands, weights)
            current = weighted.schedule()
        best = min(plans, key=lambda p: (p.predicted_s, len(p.hops)))
        return replace(best, bound_s=bound)

    def _near(self, src: str, dst: str) -> tuple[float, str]:
        return (alg.distance_s(self.links, src, dst), src)

    def _check_spans(self, spans: Sequence[Span], num_bytes: int) -> tuple[Span, ...]:
        for span in spans:
            self.topology.require(span.device, "gpu")
            if span.num_bytes < 0 or span.offset_bytes < 0 or span.end > num_bytes:
                raise ValueError(
                    f"part [{span.offset_bytes}, {span.end}) of {span.device} is not within "
                    f"[0, {num_bytes})"
                )
        return tuple(spans)

    def bound_s(self, holders: Sequence[str], dsts: Sequence[str], num_bytes: int) -> float:
        """No plan moves `num_bytes` from `holders` to every one of `dsts` sooner, in the
        model plans are priced by: for each destination, the bytes over its min cut's
        capacity plus the latency from that cut to it (and likewise for the holders'
        out-links), plus the fixed costs; the latest over destinations
        (`packing.bound_from_cuts` says why). Not the smallest rate and the largest
        latency of different destinations together: no plan need pay both at once."""
        self._refresh()
        sources = tuple(dict.fromkeys(holders))
        targets = frozenset(d for d in dsts if d not in sources)
        if not targets or num_bytes == 0:
            return 0.0
        rate = self._rate(sources, targets)
        terms = self._bounds[sources, targets][1]
        if not rate > 0:
            raise TopologyError(f"no working path from {', '.join(sources)} to every destination")
        return bound_from_cuts(self.links, terms, num_bytes)

    def packing(self, holders: Sequence[str], dsts: Sequence[str]) -> Packing | None:
        """The tree packing for this pattern (memoised until a link changes)."""
        self._refresh()
        key = (tuple(dict.fromkeys(holders)), frozenset(dsts))
        if key not in self._packings:
            # Packed on the machines involved only (the bound keeps the whole cluster):
            # a smaller search that converges sooner, and the other nodes' links stay
            # free; the full cluster is the fallback where that finds no tree.
            hosts = {self.topology.host_of(d) for d in (*key[0], *key[1])}
            local = FlowNetwork(self.links, hosts)
            found = local.pack(key[0], sorted(key[1]), bound_Bps=self._rate(key[0], key[1]))
            if found is None:
                found = self._flow_network().pack(key[0], sorted(key[1]))
            self._packings[key] = found
        return self._packings[key]

    def _rate(self, sources: tuple[str, ...], targets: frozenset[str]) -> float:
        """The max-flow rate of the worst destination, on the whole cluster."""
        key = (sources, frozenset(d for d in targets if d not in sources))
        entry = self._bounds.get(key)
        if entry is None:
            network = self._flow_network()
            cuts = network.cut_terms(self.links, sources, sorted(key[1]))
            rate = min((r for r, _ in cuts), default=0.0)
            terms = tuple(t for _, found in cuts for t in found)
            entry = self._bounds[key] = (rate, terms)
        return entry[0]

    def _flow_network(self) -> FlowNetwork:
        if self._network is None:
            self._network = FlowNetwork(self.links)
        return self._network

    def _refresh(self) -> None:
        if self._cache_version == self.links.version:
            return
        self._cache_version = self.links.version
        state = self.links.state
        if state == self._cache_state:
            return  # changed and changed back (a reservation released)
        if self._cache_state is not None:
            self._saved[self._cache_state] = _StateCaches(
                self._network, self._packings, self._bounds, self._plans
            )
            while len(self._saved) > MEMO_STATES:
                del self._saved[next(iter(self._saved))]  # the oldest state
        self._cache_state = state
        kept = self._saved.pop(state, None) or _StateCaches(None, {}, {}, {})
        self._network, self._packings = kept.network, kept.packings
        self._bounds, self._plans = kept.bounds, kept.plans

    def _flow_plans(
        self, sources: tuple[str, ...], targets: tuple[str, ...], num_bytes: int
    ) -> list[TransferPlan]:
        if not targets or num_bytes == 0:
            return [TransferPlan("noop", sources[0], targets, num_bytes, 0.0, ())]
        packing = self.packing(sources, targets)
        if packing is None or not packing.trees:
            return []
        self.plans_computed += 1
        # All trees (the bandwidth bound), and the widest tree alone (fewer messages,
        # for sizes where the per-piece cost outweighs the extra rate, so not tapered:
        # tapering pays where pieces are many).
        return [
            p
            for trees in {packing.trees, packing.trees[:1]}
            for p in self._packed_plans(
                "flow_trees",
                Packing(trees, sum(r for _, r in trees), packing.bound_Bps, packing.rounds),
                sources,
                targets,
                num_bytes,
                taper=trees == packing.trees,
            )
        ]

    def _rail_plans(self, src: str, targets: tuple[str, ...], num_bytes: int) -> list[TransferPlan]:
        """The rail-aligned trees (`transfer/rails.py`): scatter to the source host's
        rail owners, across on every rail, all-gather on each host."""
        packing = rail_packing(self.links, self._flow_network(), src, targets)
        if packing is None:
            return []
        return self._packed_plans("rail_trees", packing, (src,), targets, num_bytes)

    def _chain_plans(
        self, name: str, src: str, targets: tuple[str, ...], num_bytes: int
    ) -> list[TransferPlan]:
        """A chain through every destination on links its hops have to themselves
        (`chains.disjoint_chain`), or two half-rate chains through mates
        (`chains.paired_chains`), aiming at the max-flow rate."""
        if len(targets) < 2:
            return []
        rate = self._rate((src,), frozenset(targets))
        network = self._flow_network()
        if name == "disjoint_chain":
            found = disjoint_chain(self.links, network, src, targets, rate)
            if found is None:
                return []
            shape = Packing((found,), found[1], rate, 0)
        else:
            trees = paired_chains(self.links, network, src, targets, rate)
            if trees is None:
                return []
            rates = fair_rates(network, trees)
            kept = tuple((t, r) for t, r in zip(trees, rates, strict=True) if r > 0)
            if len(kept) < len(trees):
                return []
            shape = Packing(kept, sum(rates), rate, 0)
        return self._packed_plans(name, shape, (src,), targets, num_bytes)

    def _packed_plans(
        self,
        name: str,
        shape: Packing,
        sources: tuple[str, ...],
        targets: tuple[str, ...],
        num_bytes: int,
        *,
        taper: bool = True,
    ) -> list[TransferPlan]:
        """A packing's trees as plans: hops at their share of each link, each tree in its
        own piece count, and up to `REWEIGHT_ROUNDS` rebalancings of the bytes per tree
        so that deep trees carry fewer and all finish together (every try kept); with
        `taper`, the best of those again in tapered pieces."""
        plans = []
        tries: list[tuple[list[Hop], list[float]]] = []
        shares: list[float] | None = None
        for _ in range(REWEIGHT_ROUNDS + 1):
            hops = work_conserving(self.links, shape.hops(num_bytes, shares))
            hops = alg.chunks_per_tree(self.links, hops, self._piece_cap(len(hops)))
            finish = self.links.finish_times(hops)
            plans.append(self._packed_plan(name, sources, targets, num_bytes, hops, finish))
            tries.append((hops, finish))
            shares = _balanced_shares(shape, hops, finish, num_bytes)
            if shares is None or len(shape.trees) == 1:
                break
        # The fastest try again with tapered pieces in the trees that gain from them (a
        # closed form per tree, `alg.taper_trees`), rebalanced by the gains the form
        # expects (the tapered trees now finish sooner than the others): one evaluation.
        hops, finish = min(tries, key=lambda t: max(t[1]))
        tapered = alg.taper_trees(self.links, hops) if taper else None
        if tapered is None:
            return plans
        hops, gains = tapered
        guess = [f - g for f, g in zip(finish, gains, strict=True)]
        shares = _balanced_shares(shape, hops, guess, num_bytes)
        if shares is not None and len(shape.trees) > 1:
            even = work_conserving(self.links, shape.hops(num_bytes, shares))
            cut = alg.chunks_per_tree(self.links, even, self._piece_cap(len(even)))
            again = alg.taper_trees(self.links, cut)
            if again is not None:
                hops = again[0]
        plans.append(
            self._packed_plan(
                name, sources, targets, num_bytes, hops, self.links.finish_times(hops)
            )
        )
        return plans

    def _piece_cap(self, num_hops: int) -> int:
        """The most pieces a hop of a plan of `num_hops` hops may be cut into."""
        return max(1, min(self.max_chunks, MAX_PIECES // max(1, num_hops)))

    @staticmethod
    def _packed_plan(
        name: str,
        sources: tuple[str, ...],
        targets: tuple[str, ...],
        num_bytes: int,
        hops: Sequence[Hop],
        finish: Sequence[float],
    ) -> TransferPlan:
        holder = hops[0].src
        return TransferPlan(
            name,
            holder if holder in sources else sources[0],
            targets,
            num_bytes,
            max(finish),
            tuple(hops),
            max(h.chunks for h in hops),
            holders=sources,
        )

    def candidates(
        self,
        src: str,
        dsts: Sequence[str] | str,
        num_bytes: int,
        *,
        algorithms: Iterable[str] | None = None,
    ) -> list[TransferPlan]:
        """Every applicable algorithm's plan, priced; at least one."""
        targets = self._check_request(src, dsts, num_bytes)
        names = self._check_algorithms(algorithms) if algorithms is not None else self.algorithms
        self.plans_computed += 1
        if not targets or num_bytes == 0:
            return [TransferPlan("noop", src, targets, num_bytes, 0.0, ())]
        plans = []
        for name in names:
            if name == "flow_trees":
                plans.extend(self._flow_plans((src,), targets, num_bytes))
                continue
            if name == "rail_trees":
                plans.extend(self._rail_plans(src, targets, num_bytes))
                continue
            if name in ("disjoint_chain", "paired_chains"):
                plans.extend(self._chain_plans(name, src, targets, num_bytes))
                continue
            for hops in self._build(name, src, targets, num_bytes):
                chunks = 1
                if name in PIPELINED:
                    chunks = alg.best_chunks(self.links, hops, self.max_chunks)
                    hops = alg.with_chunks(hops, chunks)
                plans.append(
                    TransferPlan(
                        name,
                        src,
                        targets,
                        num_bytes,
                        self.links.evaluate(hops),
                        tuple(hops),
                        chunks,
                    )
                )
        if not plans:
            raise TopologyError(
                f"no algorithm among {', '.join(names)} applies to {src} -> {', '.join(targets)}"
            )
        return plans

    def _build(self, name: str, src: str, dsts: tuple[str, ...], num_bytes: int) -> list[list[Hop]]:
        t = self.links
        single = len(dsts) == 1
        builders: dict[str, Callable[[], list[Hop]]] = {
            "direct": lambda: alg.direct(t, src, dsts, num_bytes),
            "stripe": lambda: alg.stripes(t, src, dsts[0], num_bytes) if single else [],
            "rail_stripe": lambda: alg.rail_stripes(t, src, dsts[0], num_bytes) if single else [],
            "chain": lambda: alg.chain(t, src, dsts, num_bytes) if not single else [],
            "binomial_tree": lambda: (
                alg.binomial_tree(t, src, dsts, num_bytes) if len(dsts) > 2 else []
            ),
            "packed_trees": lambda: (
                alg.packed_trees(t, src, dsts, num_bytes)
                if 2 <= len(dsts) <= MAX_PACKED_DESTINATIONS
                else []
            ),
            "hierarchical": lambda: self._hierarchical(src, dsts, num_bytes, False),
            "hierarchical_chain": lambda: self._hierarchical(src, dsts, num_bytes, True),
        }
        hops = builders[name]()
        return [hops] if hops else []

    def _hierarchical(
        self, src: str, dsts: tuple[str, ...], num_bytes: int, leaders_in_chain: bool
    ) -> list[Hop]:
        hosts = {self.topology.host_of(d) for d in dsts}
        remote = hosts - {self.topology.host_of(src)}
        # Only meaningful across hosts; with one remote host both variants coincide.
        if not remote or len(dsts) < 2 or (leaders_in_chain and len(remote) < 2):
            return []
        return alg.hierarchical(self.links, src, dsts, num_bytes, leaders_in_chain=leaders_in_chain)

    def predict_s(self, hops: Sequence[Hop]) -> float:
        """Price arbitrary hops under the current model (used to check plans)."""
        return self.links.evaluate(hops)

    # the router's hot path ---------------------------------------------------------------
    def estimate_s(self, src: str, dsts: Sequence[str] | str, num_bytes: int) -> float:
        """Predicted seconds to move `num_bytes` from `src` to all of `dsts`.

        Memoised per (src, destination set, size octave): the best plan is priced at the
        octave's two ends once, and sizes between are interpolated linearly (the best-plan
        time is concave in size, so this errs low by a little inside an octave)."""
        state = self.links.state
        memo = self._memos.get(state)
        if memo is None:
            if len(self._memos) >= MEMO_STATES:
                del self._memos[next(iter(self._memos))]  # the oldest state
            memo = self._memos[state] = {}
        octave = num_bytes.bit_length()
        # One destination (the router's every quote) is keyed by its name: no set built.
        one = dsts if isinstance(dsts, str) else dsts[0] if len(dsts) == 1 else None
        key = (src, one if one is not None else frozenset(dsts), octave)
        entry = memo.get(key)
        if entry is None:
            group = frozenset((one,)) if one is not None else frozenset(dsts)
            klass = self._symmetry_class(src, group, octave)
            if klass is not None:
                entry = self._class_memo.get(klass)
            if entry is None:
                # Every octave of a class is priced on one pair of it: its flow network,
                # bound and packing are then computed once, not once an octave.
                pair = self._representative(klass) if klass is not None else None
                at, to = pair if pair is not None else (src, dsts)
                entry = self._price_octave(at, to, octave)
                if klass is not None:
                    self._class_memo[klass] = entry
            memo[key] = entry
        low_bytes, low_s, slope = entry
        return low_s + (num_bytes - low_bytes) * slope

    def _symmetry_class(
        self, src: str, dsts: frozenset[str], octave: int
    ) -> tuple[bool, str, str, int] | None:
        """(same host, source GPU, destination GPU, octave) for one preset GPU pair on
        the link table as built; None where the pair's own price must be computed."""
        if not self.by_symmetry or not self.links.as_built or len(dsts) != 1:
            return None
        (dst,) = dsts
        a = _PRESET_GPU.fullmatch(src)
        b = _PRESET_GPU.fullmatch(dst)
        if a is None or b is None or src == dst:
            return None
        if a[1] != b[1]:
            return (False, a[2], b[2], octave)
        # Within a host, pairs an automorphism maps onto each other are one class.
        rep = self._pair_classes().get((a[2], b[2]))
        if rep is None:
            return (True, a[2], b[2], octave)
        return (True, rep[0], rep[1], octave)

    def _pair_classes(self) -> dict[tuple[str, str], tuple[str, str]]:
        """GPU index pairs on one host -> their class's first pair (on host n0)."""
        if self._host_pairs is None:
            gpus = [g for g in self.topology.gpus() if _PRESET_GPU.fullmatch(g) is not None]
            first = [g for g in gpus if g.startswith("n0.")]
            classes = pair_classes(self.topology, "n0", first) if first else {}
            index = {g: g[len("n0.gpu") :] for g in first}
            self._host_pairs = {
                (index[a], index[b]): (index[c], index[d]) for (a, b), (c, d) in classes.items()
            }
        return self._host_pairs

    def _representative(self, klass: tuple[bool, str, str, int]) -> tuple[str, str] | None:
        """The pair of a symmetry class on the first host (and the second, across)."""
        same_host, a, b, _octave = klass
        src, dst = f"n0.gpu{a}", f"n{0 if same_host else 1}.gpu{b}"
        topo = self.topology
        if src in topo and dst in topo and (topo.host_of(src) == topo.host_of(dst)) == same_host:
            return src, dst
        return None

    def _price_octave(self, src: str, dsts: Sequence[str] | str, octave: int) -> Octave:
        if octave == 0:
            return (0.0, 0.0, 0.0)
        low = 1 << (octave - 1)
        low_s = self.plan(src, dsts, low).predicted_s
        high_s = self.plan(src, dsts, 2 * low).predicted_s
        return (float(low), low_s, (high_s - low_s) / low)

    # adaptation --------------------------------------------------------------------------
    def observe(self, plan: TransferPlan, measured_s: float) -> None:
        """Fold a measured transfer time into the link model (EWMA).

        The plan's predicted time splits into a latency part (all bandwidth infinite) and
        a bandwidth part. The measured excess over the latency part says how fast the
        plan's bottleneck links really were; with nothing left over, latency was
        overestimated instead."""
        if not math.isfinite(measured_s) or measured_s <= 0:
            raise ValueError(f"measured time must be a positive number, got {measured_s!r}")
        if not plan.hops:
            return
        hops = plan.hops
        predicted = self.links.evaluate(hops)
        latency_part = self.links.evaluate(hops, bandwidth_scale=math.inf)
        bandwidth_part = predicted - latency_part
        w = self.ewma_weight
        if bandwidth_part > 0 and measured_s > latency_part * 1.000001:
            ratio = min(100.0, max(0.01, bandwidth_part / (measured_s - latency_part)))
            costs = self.links.timed_costs(hops)
            factor = 1 - w + w * ratio
            for u, v in sorted({link for c in costs for link in c.bottleneck}):
                self.links.set_bandwidth(u, v, self.links.bandwidth(u, v) * factor)
            for node in sorted({n for c in costs for n in c.bottleneck_nodes}):
                self.links.set_throughput(node, (self.links.throughput(node) or 0.0) * factor)
        elif latency_part > 0:
            ratio = measured_s / latency_part
            for u, v in sorted({link for h in hops for link in h.links()}):
                current = self.links.latency(u, v)
                self.links.set_latency(u, v, current * (1 - w + w * ratio))

    def mark_link_down(self, u: str, v: str) -> None:
        """Plan around a failed link from the next plan on."""
        self.links.mark_down(u, v)

    def mark_link_up(self, u: str, v: str) -> None:
        self.links.mark_up(u, v)

    def reserve(self, plan: TransferPlan) -> None:
        """Count a running transfer's links as busy, so plans made meanwhile share them."""
        self.links.add_load(link for links in own_links(plan.hops) for link in links)

    def release(self, plan: TransferPlan) -> None:
        self.links.add_load((link for links in own_links(plan.hops) for link in links), count=-1)

    # validation --------------------------------------------------------------------------
    def _check_request(
        self, src: str, dsts: Sequence[str] | str, num_bytes: int
    ) -> tuple[str, ...]:
        if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 0:
            raise ValueError(f"num_bytes must be a non-negative integer, got {num_bytes!r}")
        targets = [dsts] if isinstance(dsts, str) else list(dsts)
        self.topology.require(src, "gpu")
        for d in targets:
            self.topology.require(d, "gpu")
        # The source already holds the bytes; duplicates need them once.
        return tuple(d for d in dict.fromkeys(targets) if d != src)

    @staticmethod
    def _check_algorithms(names: Iterable[str]) -> tuple[str, ...]:
        chosen = tuple(names)
        unknown = [n for n in chosen if n not in ALGORITHMS]
        if unknown or not chosen:
            raise ValueError(
                f"unknown algorithm(s) {', '.join(unknown) or '(none)'}; "
                f"known: {', '.join(ALGORITHMS)}"
            )
        return chosen


def _balanced_shares(
    packing: Packing, hops: Sequence[Hop], finish: Sequence[float], num_bytes: int
) -> list[float] | None:
    """Bytes per tree so that every tree finishes at once: a tree's overhead (its finish
    past its bytes over its rate: fill and message delays, more for a deep tree) is paid
    on fewer bytes, bytes_i = rate_i * (T - overhead_i), T making them sum to the whole.
    None when the trees already finish together."""
    ends: dict[int, float] = {}
    sizes: dict[int, int] = {}
    tree_of_root: dict[int, int] = {}
    tree = -1
    for index, hop in enumerate(hops):
        if hop.after is None:
            # Packing.hops lists each tree's hops together, its root hops first.
            if index == 0 or hops[index - 1].offset_bytes != hop.offset_bytes:
                tree += 1
            tree_of_root[index] = tree
        else:
            tree_of_root[index] = tree_of_root[hop.after]
        t = tree_of_root[index]
        ends[t] = max(ends.get(t, 0.0), finish[index])
        sizes[t] = hop.num_bytes
    rates = [rate for _, rate in packing.trees]
    if len(ends) != len(rates):
        return None  # a tree too small to carry a byte: keep the rate split
    over = [max(0.0, ends[t] - sizes[t] / rates[t]) for t in range(len(rates))]
    if max(over) - min(over) <= 1e-3 * max(finish):
        return None
    total_rate = sum(rates)
    target = (num_bytes + sum(r * o for r, o in zip(rates, over, strict=True))) / total_rate
    shares = [max(0.0, r * (target - o)) for r, o in zip(rates, over, strict=True)]
    return shares if sum(shares) > 0 else None
