"""What a policy reads (a request and the cluster's event-fed state) and what it returns."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from wasma.core.profile import Profile
from wasma.scheduler.app_shapes import AppShapes
from wasma.scheduler.copies import CopySchedule
from wasma.scheduler.estimate_bias import EstimateBias
from wasma.scheduler.prefix_index import PrefixIndex
from wasma.scheduler.pricing import TransferPricer
from wasma.scheduler.state import ClusterState
from wasma.scheduler.workflow import finite_number
from wasma.scheduler.workflows import WorkflowRegistry


class PlacementKind(StrEnum):
    REUSE = "reuse"  # the engine already holds part of the prompt's KV
    TRANSFER = "transfer"  # the prefix KV is moved to the engine before it runs
    RECOMPUTE = "recompute"  # the whole prompt is prefilled


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What the router knows about one request when it places it."""

    request_id: str
    workflow_id: str
    node_id: str
    app: str
    prompt_tokens: int
    max_tokens: int
    block_hashes: Sequence[int]  # chain hashes of the prompt's full blocks
    arrival_s: float  # when the request reached the router
    deadline_s: float = float("inf")  # absolute time its workflow must finish by
    parents: tuple[str, ...] = ()  # node ids this request waited for
    # The engine slot this request must run on whatever the policy prefers (a Responses
    # request naming a `previous_response_id`: only that engine's store holds it).
    pinned: int | None = None


@dataclass(frozen=True, slots=True)
class TransferOrder:
    """Move the first `num_blocks` prompt blocks from engine `src` before running."""

    src: int
    num_blocks: int
    num_bytes: int
    predicted_s: float  # until the prefix is on the engine, link queue included
    # Rides a broadcast of the same prefix from `src` already in flight, where one is
    # (`CopySchedule`); drivers book the copy with the same choice.
    broadcast: bool = False


@dataclass(frozen=True, slots=True)
class Placement:
    engine: int  # slot in ClusterState
    kind: PlacementKind
    priority: int = 0  # lower runs first (vLLM priority scheduling)
    hit_blocks: int = 0  # prompt blocks expected to be reused there (after any transfer)
    transfer: TransferOrder | None = None
    # Keep this request's context KV: descendants will reuse it. Engines keep it from the
    # request's arrival until `retain_s` after it finishes (None: the driver's default
    # lease), evicting it after every block not kept.
    retain: bool = False
    retain_s: float | None = None
    # Steps-to-use: seconds from now until the requests that extend this context are
    # expected to start (None: unsaid). Engines evict the retained KV wanted latest
    # first, and the router ends the retention once those readers have all started
    # (`scheduler/retention.py`), however long the lease.
    retain_use_s: float | None = None
    # Hold the request at the router and ask again when load drops (only when the
    # driver supports it: PolicyContext.can_defer). Nothing is dispatched or charged.
    defer: bool = False
    estimated_finish_s: float | None = None  # the policy's estimate, for reports
    # Load the prompt's CPU-tier blocks as soon as the request reaches its engine, ahead
    # of its turn in the queue (engines that load at admission otherwise).
    prefetch: bool = False
    # Order among requests held at the router (lower first); None = `priority`. Lets a
    # policy release held work by urgency while the engine runs what it gets first come,
    # first served.
    hold_priority: int | None = None

    @property
    def hold_order(self) -> int:
        return self.priority if self.hold_priority is None else self.hold_priority

    def lease_s(self, default: float) -> float:
        """The retention lease to ask the engine for (0: none): the policy's own, else
        the driver's `default`."""
        if not self.retain:
            return 0.0
        return default if self.retain_s is None else self.retain_s


@dataclass
class PolicyContext:
    """Everything a policy may read. The router owns and feeds these components."""

    state: ClusterState
    index: PrefixIndex  # what engines report they hold (KV events)
    workflows: WorkflowRegistry
    profile: Profile
    pricer: TransferPricer | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    # Whether the driver can hold a request back (`Placement.defer`) and ask again later.
    can_defer: bool = False
    # Prompts placed but not yet started: their blocks will be on that engine soon.
    inflight: PrefixIndex = field(init=False)
    # What each engine's CPU tier holds (KV events of medium "CPU"); `index` keeps the
    # GPU pools' blocks.
    cpu_index: PrefixIndex = field(init=False)
    # Learned workflow shapes per app, for workflows that arrive without a DAG.
    shapes: AppShapes = field(default_factory=AppShapes)
    # How much longer than the policy estimated requests have been taking (the router
    # feeds it from placements and finishes).
    estimates: EstimateBias = field(default_factory=EstimateBias)
    # Whether engines can relay a prefix they are receiving (GPU collectives: simulated
    # engines). The live vLLM connector pulls every copy from the holder: no.
    relay_copies: bool = False
    _copies: CopySchedule | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.inflight = PrefixIndex(self.state.engines, max_blocks=1_000_000)
        self.cpu_index = PrefixIndex(self.state.engines, max_blocks=self.index.max_blocks)
        if self.workflows.on_close is None:
            self.workflows.on_close = self.shapes.observe

    @property
    def block_size(self) -> int:
        return self.profile.block_size

    @property
    def copies(self) -> CopySchedule | None:
        """The copies the router ordered, on each engine's outbound link, priced by
        `pricer` (None without one; a new book if the pricer or `relay_copies` changes)."""
        book = self._copies
        if book is None or book.pricer is not self.pricer or book.relay != self.relay_copies:
            book = self._copies = (
                None if self.pricer is None else CopySchedule(self.pricer, self.relay_copies)
            )
        return book


class Policy(ABC):
    """Chooses an engine (and priority, and maybe a transfer) for one request."""

    name: ClassVar[str]
    params: ClassVar[Mapping[str, Any]] = {}
    # Inclusive (low, high) for numeric parameters; any other number must be >= 0.
    param_bounds: ClassVar[Mapping[str, tuple[float, float]]] = {}
    # Whether the policy reads `ctx.inflight`; the router maintains it only then.
    reads_inflight: ClassVar[bool] = False
    # Whether the policy derives constants from `ctx.profile` when built (a per-token
    # prefill price, a critical-path cache): a recalibrated profile then reaches it only
    # through a fresh instance. Others keep their state (rotation counters, prefix trees).
    uses_cost_model: ClassVar[bool] = False

    def __init__(self, ctx: PolicyContext) -> None:
        unknown = set(ctx.params) - set(self.params)
        if unknown:
            raise ValueError(
                f"policy {self.name!r}: unknown parameter(s) {sorted(unknown)}; "
                f"accepted: {sorted(self.params) or 'none'}"
            )
        for key, value in ctx.params.items():
            self._check_param(key, value)
        self.ctx = ctx
        self.p: dict[str, Any] = {**self.params, **ctx.params}

    def _check_param(self, key: str, value: Any) -> None:
        """A value of the default's kind, in range: a typo'd flag or config value fails
        here, naming itself, instead of mid-run or not at all."""
        default = self.params[key]
        where = f"policy {self.name!r}: {key}"
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"{where} must be true or false, got {value!r}")
            return
        if isinstance(default, str):
            if not isinstance(value, str):
                raise ValueError(f"{where} must be a string, got {value!r}")
            return
        if value is None and default is None:
            return
        whole = isinstance(default, int)
        low, high = self.param_bounds.get(key, (0.0, math.inf))
        if not (
            finite_number(value) and (isinstance(value, int) or not whole) and low <= value <= high
        ):
            kind = "an integer" if whole else "a number"
            span = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
            raise ValueError(f"{where} must be {kind} {span}, got {value!r}")

    @abstractmethod
    def place(self, req: RequestInfo, now: float) -> Placement: ...

    def healthy_slots(self) -> list[int]:
        slots = self.ctx.state.healthy_slots()
        if not slots:
            raise NoHealthyEngine("no healthy engine to place the request on")
        return slots


class NoHealthyEngine(RuntimeError):
    pass


def kind_for(hit_blocks: int, transfer: TransferOrder | None = None) -> PlacementKind:
    if transfer is not None:
        return PlacementKind.TRANSFER
    return PlacementKind.REUSE if hit_blocks > 0 else PlacementKind.RECOMPUTE
