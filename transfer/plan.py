"""Transfer plans: what an executor runs and a person can read."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from wasma.transfer.units import format_bytes, format_seconds


@dataclass(frozen=True)
class Hop:
    """Send bytes [offset_bytes, offset_bytes + num_bytes) from `src` to `dst`.

    The range goes in `chunks` pieces (integer boundaries, see `chunk_bounds`), in order:
    equal ones, or with `taper` > 0 the first and last `taper` pieces shrinking by `ramp`
    per step toward the ends (a small first piece starts the next hop of a tree sooner, a
    small last one ends it sooner: less pipeline fill for the same piece count). `after`
    is the index of the hop that delivers this range to `src` (None when `src` holds it
    from the start); a piece is forwarded as soon as it has arrived, so a chain
    pipelines. Hops of a later `stage` start only when every hop of the earlier stages is
    done (a round barrier, as in a binomial tree).

    `multicast` names the first hop of the multicast this hop belongs to (its own index
    for that one; None: a hop of its own). The hops of one multicast send the same pieces
    from the same sender (range, pieces, `after`, stage and rate alike) to different
    destinations; their paths share a prefix that ends at a switch able to multicast (the
    fork) and part there. Each piece crosses the prefix once and each branch once: the
    switch replicates it (NVLink SHARP), so the sender's link carries it once however many
    GPUs it reaches.
    """

    src: str
    dst: str
    path: tuple[str, ...]  # devices from src to dst inclusive
    offset_bytes: int
    num_bytes: int
    chunks: int = 1
    after: int | None = None
    stage: int = 0
    # The rate a fluid schedule gave this hop (bytes/s); None: it shares its links evenly
    # with the plan's other hops that run at the same time.
    rate_Bps: float | None = None
    taper: int = 0
    ramp: float = 1.0
    multicast: int | None = None

    def chunk_bounds(self) -> list[tuple[int, int]]:
        return chunk_bounds(self.offset_bytes, self.num_bytes, self.chunks, self.taper, self.ramp)

    def links(self) -> list[tuple[str, str]]:
        """Directed links this hop occupies (each direction of a cable is its own)."""
        return list(zip(self.path, self.path[1:], strict=False))


def group_of(index: int, hop: Hop) -> int:
    """The multicast a hop belongs to, by its first hop's index (a lone hop: its own)."""
    return index if hop.multicast is None else hop.multicast


def multicast_groups(hops: Sequence[Hop]) -> dict[int, list[int]]:
    """Hop indices of each multicast of two or more hops, keyed by its first hop."""
    groups: dict[int, list[int]] = {}
    for index, hop in enumerate(hops):
        if hop.multicast is not None:
            groups.setdefault(hop.multicast, []).append(index)
    return {first: members for first, members in groups.items() if len(members) > 1}


def fork_of(paths: Sequence[tuple[str, ...]]) -> tuple[int, str]:
    """(position, device) where the paths of one multicast part: the last device of
    their longest common prefix."""
    shortest = min(len(p) for p in paths)
    at = 0
    while at + 1 < shortest and all(p[at + 1] == paths[0][at + 1] for p in paths):
        at += 1
    return at, paths[0][at]


def own_links(hops: Sequence[Hop]) -> list[list[tuple[str, str]]]:
    """Per hop, the directed links its pieces add to what the plan carries: all of its
    path's, except those an earlier hop of its multicast already counts (the shared
    prefix up to the fork), so a multicast is counted once on the prefix and once on
    each branch. Devices on the path (`own_nodes`) likewise."""
    if all(hop.multicast is None for hop in hops):
        return [hop.links() for hop in hops]
    seen: dict[int, set[tuple[str, str]]] = {}
    out = []
    for index, hop in enumerate(hops):
        counted = seen.setdefault(group_of(index, hop), set())
        mine = [link for link in hop.links() if link not in counted]
        counted.update(mine)
        out.append(mine)
    return out


def own_nodes(hops: Sequence[Hop]) -> list[list[str]]:
    """Per hop, the devices between its ends that its pieces pass and no earlier hop of
    its multicast already counts."""
    if all(hop.multicast is None for hop in hops):
        return [list(hop.path[1:-1]) for hop in hops]
    seen: dict[int, set[str]] = {}
    out = []
    for index, hop in enumerate(hops):
        counted = seen.setdefault(group_of(index, hop), set())
        mine = [node for node in hop.path[1:-1] if node not in counted]
        counted.update(mine)
        out.append(mine)
    return out


def check_multicasts(hops: Sequence[Hop]) -> None:
    """Raise ValueError unless every multicast is one send: its hops alike but for
    destination and the branch after a common fork (a device between the ends), the
    branches' links distinct from one another and from the prefix."""
    for index, hop in enumerate(hops):
        m = hop.multicast
        if m is None:
            continue
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= index:
            raise ValueError(f"hop {index}: multicast must name itself or an earlier hop")
        lead = hops[m]
        if lead.multicast != m:
            raise ValueError(f"hop {index}: multicast {m} is not the first hop of a multicast")
        alike = ("src", "offset_bytes", "num_bytes", "chunks", "after", "stage", "rate_Bps")
        if any(getattr(hop, f) != getattr(lead, f) for f in (*alike, "taper", "ramp")):
            raise ValueError(f"hop {index} differs from hop {m} of its multicast but in dst")
    for first, members in multicast_groups(hops).items():
        paths = [hops[i].path for i in members]
        dsts = [hops[i].dst for i in members]
        if len(set(dsts)) != len(dsts):
            raise ValueError(f"multicast {first} reaches a destination twice")
        at, fork = fork_of(paths)
        if at == 0 or fork in dsts:
            raise ValueError(f"multicast {first} does not fork at a switch between its ends")
        prefix = set(itertools.pairwise(paths[0][: at + 1]))
        branches: set[tuple[str, str]] = set()
        for path in paths:
            branch = set(itertools.pairwise(path[at:]))
            if branch & (branches | prefix):
                raise ValueError(f"multicast {first}: two branches share a link past {fork}")
            branches |= branch


@dataclass(frozen=True)
class Span:
    """Bytes [offset_bytes, offset_bytes + num_bytes) on `device`: a part a gather's
    holder has, or a part a scatter's destination wants."""

    device: str
    offset_bytes: int
    num_bytes: int

    @property
    def end(self) -> int:
        return self.offset_bytes + self.num_bytes


def even_spans(devices: Sequence[str], num_bytes: int) -> tuple[Span, ...]:
    """`num_bytes` cut into one consecutive part per device (integer boundaries)."""
    n = len(devices)
    return tuple(
        Span(d, i * num_bytes // n, (i + 1) * num_bytes // n - i * num_bytes // n)
        for i, d in enumerate(devices)
    )


# Integer weights of `chunk_bounds`: a middle piece weighs WEIGHT_UNIT, and the ramp is
# read in units of 1 / RAMP_UNIT (a float times a power of two is exact), so every
# machine running a plan cuts it at the same bytes: no floating-point power is involved.
WEIGHT_UNIT = 1 << 20
RAMP_UNIT = 1 << 16


def taper_weights(taper: int, ramp: float) -> list[int]:
    """Integer weights of the `taper` end pieces, the outermost first: each is the next
    one inward divided by `ramp`, the one next to the middle WEIGHT_UNIT / ramp."""
    step = round(ramp * RAMP_UNIT)
    weights = []
    weight = WEIGHT_UNIT
    for _ in range(taper):
        weight = max(1, weight * RAMP_UNIT // step)
        weights.append(weight)
    return weights[::-1]


def chunk_bounds(
    offset: int, length: int, chunks: int, taper: int = 0, ramp: float = 1.0
) -> list[tuple[int, int]]:
    """[start, end) of each piece, exact to the byte so the model and executors agree.

    Equal pieces, or (taper > 0, ramp > 1) the first and last `taper` pieces smaller by
    `ramp` per step toward the ends (`taper_weights`), the middle ones equal: bytes in
    proportion to integer weights, boundaries by integer division."""
    if taper <= 0 or ramp <= 1.0 or chunks < 3:
        edges = [offset + c * length // chunks for c in range(chunks + 1)]
        return list(itertools.pairwise(edges))
    ends = taper_weights(taper, ramp)
    if 2 * taper <= chunks:
        weights = [*ends, *[WEIGHT_UNIT] * (chunks - 2 * taper), *ends[::-1]]
    else:  # the two tapers meet: each piece takes the weight of its nearer end
        weights = [ends[min(c, chunks - 1 - c)] for c in range(chunks)]
    total = sum(weights)
    edges = [offset + c * length // total for c in itertools.accumulate(weights, initial=0)]
    return list(itertools.pairwise(edges))


@dataclass(frozen=True)
class TransferPlan:
    algorithm: str
    src: str
    dsts: tuple[str, ...]
    bytes: int
    predicted_s: float
    hops: tuple[Hop, ...]
    chunks: int = 1  # pieces per hop, for pipelined algorithms
    notes: tuple[str, ...] = field(default=())
    # Every device holding the bytes at the start (src first); empty: src alone.
    holders: tuple[str, ...] = ()
    # The lower bound no plan beats in the model plans are priced by: per destination,
    # bytes over a min cut's rate plus the latency from that cut on (the latest over
    # destinations), plus the fixed costs; None where it was not computed.
    bound_s: float | None = None
    # A gather: the part each holder has (empty: every holder has all the bytes).
    held: tuple[Span, ...] = ()
    # A scatter: the part each destination wants (empty: every destination wants all).
    wanted: tuple[Span, ...] = ()

    @property
    def pattern(self) -> str:
        return "gather" if self.held else "scatter" if self.wanted else "broadcast"

    def holdings(self, device: str) -> list[tuple[int, int]]:
        """[start, end) ranges `device` has before the transfer."""
        if self.held:
            return [(s.offset_bytes, s.end) for s in self.held if s.device == device]
        return [(0, self.bytes)] if device in self.sources else []

    def wants(self, device: str) -> list[tuple[int, int]]:
        """[start, end) ranges `device` must have after it."""
        if self.wanted:
            return [(s.offset_bytes, s.end) for s in self.wanted if s.device == device]
        return [(0, self.bytes)] if device in self.dsts else []

    @property
    def receivers(self) -> tuple[str, ...]:
        """Every device that must end with bytes: the destinations (a scatter's parts
        name them too)."""
        return tuple(dict.fromkeys([*self.dsts, *(s.device for s in self.wanted)]))

    @property
    def sources(self) -> tuple[str, ...]:
        return self.holders or (self.src,)

    @property
    def ratio(self) -> float | None:
        """predicted_s / bound_s (1.0 is optimal)."""
        if self.bound_s is None:
            return None
        if self.bound_s <= 0:
            return 1.0
        return self.predicted_s / self.bound_s

    @property
    def devices(self) -> list[str]:
        seen = dict.fromkeys([*self.sources, *self.dsts])
        for hop in self.hops:
            seen.setdefault(hop.src)
            seen.setdefault(hop.dst)
        return list(seen)

    @property
    def steps(self) -> list[str]:
        """One readable line per hop, in plan order."""
        lines = []
        for index, hop in enumerate(self.hops):
            via = hop.path[1:-1]
            line = (
                f"{index}: {hop.src} -> {hop.dst}  {format_bytes(hop.num_bytes)}"
                f" [{hop.offset_bytes}, {hop.offset_bytes + hop.num_bytes})"
            )
            if hop.chunks > 1:
                line += f" in {hop.chunks} chunks"
                if hop.taper and hop.ramp != 1.0:
                    line += f" (ends tapered x{hop.ramp:g} over {hop.taper})"
            if via:
                line += f" via {' > '.join(via)}"
            if hop.after is not None:
                line += f", forwarding hop {hop.after}"
            if hop.stage:
                line += f", round {hop.stage}"
            if hop.rate_Bps is not None:
                line += f" at {hop.rate_Bps / 1e9:.1f} GB/s"
            if hop.multicast is not None:
                first = hop.multicast == index
                line += ", multicast" if first else f", multicast with hop {hop.multicast}"
            lines.append(line)
        return lines

    def describe(self) -> str:
        rate = self.bytes / self.predicted_s / 1e9 if self.predicted_s > 0 else 0.0
        pattern = "" if self.pattern == "broadcast" else f" ({self.pattern})"
        head = (
            f"{self.algorithm}{pattern}: {format_bytes(self.bytes)} from "
            f"{', '.join(self.sources)} to "
            f"{', '.join(self.dsts)}; predicted {format_seconds(self.predicted_s)}"
            f" ({rate:.1f} GB/s per destination)"
        )
        lines = [head]
        if self.bound_s is not None:
            lines.append(
                f"bound {format_seconds(self.bound_s)} (max-flow rate plus latency floor); "
                f"ratio {self.ratio:.3f}"
            )
        return "\n".join([*lines, *("  " + s for s in self.steps), *self.notes])

    def to_dict(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "predicted_s": self.predicted_s,
            "bound_s": self.bound_s,
            "ratio": self.ratio,
            "steps": self.steps,
            "src": self.src,
            "holders": list(self.sources),
            "dsts": list(self.dsts),
            "bytes": self.bytes,
            "chunks": self.chunks,
            "pattern": self.pattern,
            "held": [asdict(x) for x in self.held],
            "wanted": [asdict(x) for x in self.wanted],
            "hops": [asdict(h) for h in self.hops],
        }


def check_plan(plan: TransferPlan) -> None:
    """Raise ValueError unless every hop sends bytes its sender holds (from the start, or
    from the hop that delivers them) and every destination ends up with what it wants.
    Executors call this before moving anything (and multicasts are one send each,
    `check_multicasts`; whether the fork can multicast is the topology's to say, which
    the link model checks when it prices the plan)."""
    for span in (*plan.held, *plan.wanted):
        if span.num_bytes < 0 or span.offset_bytes < 0 or span.end > plan.bytes:
            raise ValueError(f"part [{span.offset_bytes}, {span.end}) of {span.device} invalid")
    held: dict[str, list[tuple[int, int]]] = {}
    for device in {*plan.sources, *(s.device for s in plan.held)}:
        held[device] = plan.holdings(device)
    stages = [h.stage for h in plan.hops]
    if stages != sorted(stages):
        raise ValueError("hops must be listed in round order")
    check_multicasts(plan.hops)
    for index, hop in enumerate(plan.hops):
        lo, hi = hop.offset_bytes, hop.offset_bytes + hop.num_bytes
        if hop.num_bytes < 0 or lo < 0 or hi > plan.bytes or hop.chunks < 1:
            raise ValueError(f"hop {index}: range [{lo}, {hi}) or chunks {hop.chunks} invalid")
        if (
            isinstance(hop.taper, bool)
            or not isinstance(hop.taper, int)
            or hop.taper < 0
            or not 1.0 <= hop.ramp < float("inf")
        ):
            raise ValueError(f"hop {index}: taper {hop.taper} or ramp {hop.ramp} invalid")
        if (
            hop.src == hop.dst
            or not hop.path
            or hop.path[0] != hop.src
            or (hop.path[-1] != hop.dst)
        ):
            raise ValueError(f"hop {index}: path must run from {hop.src} to {hop.dst}")
        if hop.after is None:
            if not any(a <= lo and hi <= b for a, b in plan.holdings(hop.src)):
                raise ValueError(f"hop {index}: {hop.src} sends bytes it does not hold")
        else:
            if not 0 <= hop.after < index:
                raise ValueError(f"hop {index}: 'after' must name an earlier hop")
            parent = plan.hops[hop.after]
            if parent.dst != hop.src:
                raise ValueError(
                    f"hop {index} forwards hop {hop.after}, which goes to "
                    f"{parent.dst}, not {hop.src}"
                )
            if not (parent.offset_bytes <= lo and hi <= parent.offset_bytes + parent.num_bytes):
                raise ValueError(f"hop {index} forwards bytes hop {hop.after} does not carry")
        held.setdefault(hop.dst, []).append((lo, hi))
    for dst in plan.receivers:
        for want_lo, want_hi in plan.wants(dst):
            covered = want_lo
            for lo, hi in sorted(held.get(dst, [])):
                if lo > covered:
                    break
                covered = max(covered, hi)
            if covered < want_hi:
                raise ValueError(
                    f"{dst} would get only bytes [{want_lo}, {covered}) of [{want_lo}, {want_hi})"
                )
