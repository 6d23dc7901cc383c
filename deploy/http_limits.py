"""Read limits on the gateway's HTTP connections: header size, header and body timeouts.

uvicorn's httptools protocol bounds none of these: a client that sends `content-length:
500` and 41 bytes holds its connection (and a file descriptor) forever, one that never
finishes its headers likewise, and a 64 MB header block is buffered whole by the parser.
nginx (`client_header_timeout`, `client_body_timeout`, `large_client_header_buffers`) and
Envoy (`request_headers_timeout`, `max_request_headers_kb`) bound them; so does this
subclass, which uvicorn takes as its `http` protocol class (`HttpLimits.protocol()`):

- the request line and headers must arrive within `header_timeout_s` of the connection
  opening or of the request's first byte (else 408 and the connection closes; between
  requests uvicorn's keep-alive timeout closes an idle connection);
- they may total `max_header_bytes` (else 431, counted as bytes arrive, so the parser
  never holds more than that plus one read);
- the body may pause at most `body_timeout_s` between reads (else 408 if no response has
  started, the connection closes in any case, and the handler sees a disconnect).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 64 << 10  # nginx's large_client_header_buffers is 4 x 8 KiB
    header_timeout_s: float = 30.0
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.max_header_bytes >= 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"{name} must be seconds > 0, got {value!r}")

    def protocol(self, codes: Counter[Any] | None = None) -> type[HttpToolsProtocol]:
        """uvicorn's httptools protocol with these limits (pass as `Config(http=...)`).
        Its refusals (408, 431) are counted in `codes` as the gateway counts its answers
        ((handler, status), the app's `state.http_codes`), so /metrics shows them."""
        return type(
            "LimitedHttpToolsProtocol",
            (LimitedHttpToolsProtocol,),
            {"limits": self, "codes": codes},
        )


_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    limits: HttpLimits = HttpLimits()
    codes: Counter[Any] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_headers = True  # between requests or inside a request's header block
        self._header_bytes = 0
        self._read_timer: asyncio.TimerHandle | None = None
        self._refused = False  # answered and closing: the parser's later callbacks no-op

    # -- timers ----------------------------------------------------------------------
    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(seconds, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if self._in_headers or (cycle is not None and not cycle.response_started):
            self._refuse(408, "the request was not received in time")
        else:
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` and close (the request cannot be read to its end)."""
        self._disarm()
        self._refused = True
        if self.codes is not None:
            self.codes[(self._handler(), status)] += 1
        body = message.encode()
        head = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])
        self.transport.write(
            head
            + b"content-type: text/plain; charset=utf-8\r\n"
            + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            + body
        )
        if self.cycle is not None:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.close()

    def _handler(self) -> str:
        """The refused request's `handler` label, where its path was read."""
        from wasma.deploy.metrics import handler_of

        url = getattr(self, "url", b"") or b""
        path = url.split(b"?", 1)[0].decode("latin-1") if isinstance(url, bytes) else ""
        return handler_of(path) if path else "other"

    # -- uvicorn's hooks -------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_headers:
            self._header_bytes += len(data)
        elif self._read_timer is not None:
            self._arm(self.limits.body_timeout_s)  # body bytes: the pause starts again
        super().data_received(data)
        if (
            self._in_headers
            and self._header_bytes > self.limits.max_header_bytes
            and not self.transport.is_closing()
        ):
            self._refuse(431, f"request headers exceed {self.limits.max_header_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        if self._read_timer is None:
            self._arm(self.limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        # The block that completed may share its read with body bytes: measure it.
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.limits.max_header_bytes:
            self._refuse(431, f"request headers exceed {self.limits.max_header_bytes} bytes")
            return
        self._in_headers = False
        self._header_bytes = 0
        super().on_headers_complete()
        self._arm(self.limits.body_timeout_s)

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        if not self._refused:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The keep-alive timer (uvicorn's) runs until the next request's first byte;
        # from then on the header timer does.
        self._in_headers = True
        self._header_bytes = 0
