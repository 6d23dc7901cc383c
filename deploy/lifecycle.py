"""The gateway process's life cycle, as Kubernetes probes and rollouts see it.

- **Liveness** (`/live`): the process answers; never depends on an engine, so an engine
  rollout does not restart every gateway pod.
- **Readiness** (`/ready`): the router is built, at least one engine is healthy, and the
  process is not draining. Until then generation answers 503 with `Retry-After`.
- **Start-up**: the router (and through it the engines) is built in the background,
  retried with backoff, so `wasma serve` starts with no engine reachable and becomes
  ready when one answers, instead of exiting and crash-looping.
- **Drain**: on SIGTERM the process turns not-ready and answers new generation requests
  503 + `Retry-After` (+ `connection: close`) for `drain_delay_s`, long enough for the
  endpoints controller to take the pod out of the Service; then it stops accepting
  connections and lets the streams in flight run to their end, for at most
  `drain_timeout_s` (keep the pod's terminationGracePeriodSeconds above the two).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

import uvicorn

from wasma.deploy.api import ApiAnswer, error_answer

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class LifecycleConfig:
    start_retry_s: float = 1.0  # first wait between router start attempts
    start_retry_max_s: float = 15.0  # the backoff's cap
    drain_delay_s: float = 5.0  # not-ready but listening, after SIGTERM
    drain_timeout_s: float = 600.0  # most the streams in flight get to finish

    def __post_init__(self) -> None:
        for name in ("start_retry_s", "start_retry_max_s", "drain_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be seconds > 0, got {getattr(self, name)!r}")
        if not 0 <= self.drain_delay_s < float("inf"):
            raise ValueError(f"drain_delay_s must be seconds >= 0, got {self.drain_delay_s!r}")


class Lifecycle:
    """Whether the gateway is starting, serving or draining; owned by the app."""

    def __init__(self, config: LifecycleConfig | None = None) -> None:
        self.config = config or LifecycleConfig()
        self.draining = False
        self.start_error: str | None = None  # the last failed start, for /ready
        self.start_attempts = 0
        self._started = asyncio.Event()

    @property
    def started(self) -> bool:
        return self._started.is_set()

    async def start(self, build: Callable[[], Awaitable[T]], on_built: Callable[[T], None]) -> None:
        """`build()` until it succeeds, backing off between attempts; then `on_built`."""
        wait = self.config.start_retry_s
        while True:
            self.start_attempts += 1
            try:
                built = await build()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.start_error = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "router start failed (attempt %d, next in %.0f s): %s",
                    self.start_attempts,
                    wait,
                    self.start_error,
                )
                await asyncio.sleep(wait)
                wait = min(wait * 2, self.config.start_retry_max_s)
                continue
            self.start_error = None
            on_built(built)
            self._started.set()
            log.info("router started after %d attempt(s)", self.start_attempts)
            return

    def begin_drain(self) -> None:
        if not self.draining:
            log.info("draining: not ready, refusing new requests, finishing streams in flight")
        self.draining = True


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain before its own graceful shutdown: the first SIGTERM
    (or SIGINT) marks `lifecycle` draining; `drain_delay_s` later the server stops
    accepting and waits for open requests (uvicorn's `timeout_graceful_shutdown`,
    set from `drain_timeout_s`). A second signal exits at once, as uvicorn's does."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        if config.timeout_graceful_shutdown is None:
            config.timeout_graceful_shutdown = int(lifecycle.config.drain_timeout_s)
        super().__init__(config)
        self.lifecycle = lifecycle

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.lifecycle.draining or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)
            return
        self.lifecycle.begin_drain()
        delay = self.lifecycle.config.drain_delay_s
        loop: Any = asyncio.get_event_loop()
        loop.call_later(delay, super().handle_exit, sig, frame)


_PROBES = ("/live", "/ready", "/health", "/metrics")


def lifecycle_refusal(
    lifecycle: Lifecycle | None, scope: Any, generation: bool
) -> tuple[ApiAnswer, list[tuple[bytes, bytes]]] | None:
    """The 503 a request gets while the gateway starts or drains, or None to serve it.
    Probes and scrapes always go through; while draining, so does everything but new
    work (generation, registering workflows), which a draining pod must not accept."""
    if lifecycle is None or scope["path"].startswith(_PROBES):
        return None
    if lifecycle.draining and (generation or scope["method"] == "POST"):
        err = error_answer("the gateway is shutting down; retry", 503, retry_after_s=1.0)
        return err, [(b"connection", b"close")]
    if not lifecycle.started and (generation or scope["path"].startswith("/v1/")):
        # The start error (engine addresses) is for the operator: /ready and the log.
        err = error_answer(
            "the gateway is starting: no engine reachable yet", 503, retry_after_s=2.0
        )
        return err, []
    return None
