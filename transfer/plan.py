"""Transfer plans: what an executor runs and a person can read."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from wasma.transfer.units import format_bytes, format_seconds


@dataclass(frozen=True)
class Hop:
    """Send bytes [offset_bytes, offset_bytes + num_bytes) from `src` to `dst`.

    The range goes in `chunks` equal pieces (integer boundaries, see `chunk_bounds`), in
    order. `after` is the index of the hop that delivers this range to `src` (None when
    `src` holds it from the start); a piece is forwarded as soon as it has arrived, so a
    chain pipelines. Hops of a later `stage` start only when every hop of the earlier
    stages is done (a round barrier, as in a binomial tree).
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

    def chunk_bounds(self) -> list[tuple[int, int]]:
        return chunk_bounds(self.offset_bytes, self.num_bytes, self.chunks)

    def links(self) -> list[tuple[str, str]]:
        """Directed links this hop occupies (each direction of a cable is its own)."""
        return list(zip(self.path, self.path[1:], strict=False))


def chunk_bounds(offset: int, length: int, chunks: int) -> list[tuple[int, int]]:
    """[start, end) of each piece; equal to a byte, so the model and executors agree."""
    return [
        (offset + c * length // chunks, offset + (c + 1) * length // chunks) for c in range(chunks)
    ]


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
    # The lower bound no plan beats: bytes over the max-flow (min-cut) rate to the worst
    # destination, plus the latency floor; None where it was not computed.
    bound_s: float | None = None

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
            if via:
                line += f" via {' > '.join(via)}"
            if hop.after is not None:
                line += f", forwarding hop {hop.after}"
            if hop.stage:
                line += f", round {hop.stage}"
            if hop.rate_Bps is not None:
                line += f" at {hop.rate_Bps / 1e9:.1f} GB/s"
            lines.append(line)
        return lines

    def describe(self) -> str:
        rate = self.bytes / self.predicted_s / 1e9 if self.predicted_s > 0 else 0.0
        head = (
            f"{self.algorithm}: {format_bytes(self.bytes)} from {', '.join(self.sources)} to "
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
            "hops": [asdict(h) for h in self.hops],
        }


def check_plan(plan: TransferPlan) -> None:
    """Raise ValueError unless every hop sends bytes its sender holds and every destination
    ends up with the whole range. Executors call this before moving anything."""
    held: dict[str, list[tuple[int, int]]] = {s: [(0, plan.bytes)] for s in plan.sources}
    stages = [h.stage for h in plan.hops]
    if stages != sorted(stages):
        raise ValueError("hops must be listed in round order")
    for index, hop in enumerate(plan.hops):
        lo, hi = hop.offset_bytes, hop.offset_bytes + hop.num_bytes
        if hop.num_bytes < 0 or lo < 0 or hi > plan.bytes or hop.chunks < 1:
            raise ValueError(f"hop {index}: range [{lo}, {hi}) or chunks {hop.chunks} invalid")
        if (
            hop.src == hop.dst
            or not hop.path
            or hop.path[0] != hop.src
            or (hop.path[-1] != hop.dst)
        ):
            raise ValueError(f"hop {index}: path must run from {hop.src} to {hop.dst}")
        if hop.after is None:
            if hop.src not in plan.sources:
                raise ValueError(f"hop {index}: {hop.src} sends without receiving first")
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
    for dst in plan.dsts:
        covered = 0
        for lo, hi in sorted(held.get(dst, [])):
            if lo > covered:
                break
            covered = max(covered, hi)
        if covered < plan.bytes:
            raise ValueError(f"{dst} would get only bytes [0, {covered}) of {plan.bytes}")
