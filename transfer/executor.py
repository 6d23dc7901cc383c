"""The executor interface: run a `TransferPlan`, really moving the bytes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import TracebackType

import numpy as np

from wasma.transfer.plan import TransferPlan


@dataclass(frozen=True)
class ExecutionResult:
    plan: TransferPlan
    backend: str
    elapsed_s: float  # from the common start to the last byte landing
    hop_finish_s: tuple[float, ...]  # per hop, seconds after the start
    verified: bool  # every destination holds exactly the source's bytes

    @property
    def throughput_Bps(self) -> float:
        """Bytes delivered to each destination per second."""
        return self.plan.bytes / self.elapsed_s if self.elapsed_s > 0 else 0.0


class TransferFailed(RuntimeError):
    """A hop could not complete (a peer died, a connection broke, data did not verify)."""


class Executor(ABC):
    """Runs plans. Backends differ in how a hop moves bytes, not in what a plan means:
    hop ranges, pieces, forwarding (`after`) and round barriers (`stage`) as in `Hop`."""

    name: str = "executor"

    @abstractmethod
    def run(
        self,
        plan: TransferPlan,
        payload: bytes | memoryview | None = None,
        *,
        timeout_s: float = 120.0,
    ) -> ExecutionResult:
        """Move `payload` (default: a seeded pattern of plan.bytes) along `plan`."""

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release anything held between runs."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def pattern(num_bytes: int, seed: int = 0) -> np.ndarray:
    """A seeded byte pattern: random enough that a misplaced piece fails verification."""
    return np.random.default_rng(seed).integers(0, 256, size=num_bytes, dtype=np.uint8)
