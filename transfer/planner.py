"""The transfer planner: builds candidate plans, prices them under the alpha-beta model
with link sharing, keeps the fastest, and learns link speeds from measured transfers."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from wasma.transfer import algorithms as alg
from wasma.transfer.costmodel import LinkTable
from wasma.transfer.plan import Hop, TransferPlan
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
)
PIPELINED = frozenset(
    {"chain", "rail_stripe", "packed_trees", "hierarchical", "hierarchical_chain"}
)
# Packed trees need n^2 hops; past this many destinations they cost more to price than
# they can gain over a chain.
MAX_PACKED_DESTINATIONS = 16


class Planner:
    """Plans moves of `num_bytes` from one device to others on a `Topology`.

    `estimate_s` is the router's price: memoised per (source, destination set, size
    octave) and interpolated inside the octave, so a repeat call is a dict lookup.
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
    ) -> None:
        if not 0 < ewma_weight <= 1:
            raise ValueError("ewma_weight must be in (0, 1]")
        if max_chunks < 1:
            raise ValueError("max_chunks must be >= 1")
        self.topology = topology
        self.links = LinkTable(topology, per_message_s, per_hop_s)
        self.max_chunks = max_chunks
        self.ewma_weight = ewma_weight
        self.algorithms = self._check_algorithms(algorithms or ALGORITHMS)
        self.plans_computed = 0  # how often a plan was built (memoisation shows here)
        self._memo: dict[tuple[str, frozenset[str], int], tuple[float, float, float]] = {}
        self._memo_version = self.links.version

    # planning ----------------------------------------------------------------------------
    def plan(
        self,
        src: str,
        dsts: Sequence[str] | str,
        num_bytes: int,
        *,
        algorithms: Iterable[str] | None = None,
    ) -> TransferPlan:
        """The fastest candidate plan under the current link model."""
        candidates = self.candidates(src, dsts, num_bytes, algorithms=algorithms)
        return min(candidates, key=lambda p: (p.predicted_s, len(p.hops)))

    def plan_from(
        self,
        holders: Sequence[str],
        dsts: Sequence[str] | str,
        num_bytes: int,
        *,
        algorithms: Iterable[str] | None = None,
    ) -> TransferPlan:
        """Best plan from whichever holder of the bytes can deliver them soonest."""
        if not holders:
            raise TopologyError("no holder given")
        targets = [dsts] if isinstance(dsts, str) else list(dsts)
        plans = [
            self.plan(h, [d for d in targets if d not in holders], num_bytes, algorithms=algorithms)
            for h in dict.fromkeys(holders)
        ]
        return min(plans, key=lambda p: p.predicted_s)

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
        if self._memo_version != self.links.version:
            self._memo.clear()
            self._memo_version = self.links.version
        octave = num_bytes.bit_length()
        key = (src, frozenset((dsts,) if isinstance(dsts, str) else dsts), octave)
        entry = self._memo.get(key)
        if entry is None:
            entry = self._price_octave(src, dsts, octave)
            self._memo[key] = entry
        low_bytes, low_s, slope = entry
        return low_s + (num_bytes - low_bytes) * slope

    def _price_octave(
        self, src: str, dsts: Sequence[str] | str, octave: int
    ) -> tuple[float, float, float]:
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
        self.links.add_load(link for hop in plan.hops for link in hop.links())

    def release(self, plan: TransferPlan) -> None:
        self.links.add_load((link for hop in plan.hops for link in hop.links()), count=-1)

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
