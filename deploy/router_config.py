"""The live router's settings: one dataclass instead of a constructor of many arguments."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from wasma.engines.base import DEFAULT_RETAIN_S
from wasma.scheduler.calibration import CalibrationConfig


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "wasma"
    params: Mapping[str, Any] = field(default_factory=dict)
    # Requests live or held at once; one more is refused with 429. None: sized from the
    # engines (deploy/deadline_shedding.py's default_limit), not a fixed number.
    max_outstanding: int | None = None
    # Refuse at once (503 + Retry-After) a request whose workflow's deadline is out of
    # reach even on the least loaded engine, rather than hold it to finish late.
    shed_past_deadline: bool = True
    stats_interval_s: float = 0.25  # engine health and load polls
    # A live workflow (no registered DAG) with nothing open this long is over.
    idle_workflow_s: float = 60.0
    # One past its deadline closes (its outcome settled) once idle this long: an agent's
    # next turn just after the deadline still belongs to the run, and makes it a miss.
    settle_workflow_s: float = 5.0
    # A request waiting this long for its next chunk (the first one included) while its
    # engine produced nothing for anyone counts the engine as stalled, and moves; an
    # engine busy with others only stalls a request past 5x this.
    request_timeout_s: float = 60.0
    health_timeout_s: float = 5.0
    max_failovers: int = 3  # engines a request may move to before it fails
    breaker_base_s: float = 1.0
    breaker_max_s: float = 30.0
    # Cost calibration from finished requests; None: on unless every engine is simulated.
    calibration: CalibrationConfig | bool | None = None
    held_recheck_s: float = 0.5  # a held request asks again at least this often
    # A held request goes through after this long even while engines are busy: its
    # client is waiting on an open connection, and would otherwise time out on work
    # that was accepted (a hopeless workflow can be held as long as overload lasts).
    max_hold_s: float = 300.0
    # How long after it finishes an engine keeps the KV of a request the policy marks
    # `retain`, when the policy does not size the lease itself (`Placement.retain_s`).
    retain_lease_s: float = DEFAULT_RETAIN_S

    def __post_init__(self) -> None:
        if not self.max_hold_s > 0:
            raise ValueError(f"max_hold_s must be > 0, got {self.max_hold_s!r}")
