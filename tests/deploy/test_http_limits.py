"""Slow and over-size clients at the HTTP edge (deploy/http_limits.py): unfinished
headers or bodies are dropped after their timeout, an over-size header block is a 431
read no further than the limit, and well-behaved keep-alive clients are untouched."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from wasma.core.profile import load_profile
from wasma.deploy.gateway import GatewayConfig, create_app
from wasma.deploy.http_limits import HttpLimits
from wasma.deploy.router_client import LocalRouterClient, RouterClient
from wasma.deploy.router_service import RouterService
from wasma.deploy.serve import ServerThread
from wasma.engines.sim_engine import SimEngine
from wasma.engines.tiny_model import VOCAB_SIZE

LIMITS = HttpLimits(max_header_bytes=8192, header_timeout_s=0.5, body_timeout_s=0.5)


@pytest.fixture(scope="module")
def server(sim_frontend: Any) -> Iterator[ServerThread]:
    profile = load_profile("tiny-cpu")

    async def factory() -> RouterClient:
        service = RouterService(
            [SimEngine("s0", profile, speed=50.0, vocab_size=VOCAB_SIZE)], profile
        )
        await service.start()
        return LocalRouterClient(service)

    app = create_app(factory, sim_frontend, GatewayConfig())
    with ServerThread(app, limits=LIMITS) as srv:
        yield srv


def _count(srv: ServerThread, handler: str, code: int) -> float:
    """wasma_http_requests_total for (code, handler) on the gateway's /metrics."""
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    key = f'wasma_http_requests_total{{code="{code}",handler="{handler}"}} '
    for line in text.splitlines():
        if line.startswith(key):
            return float(line[len(key) :])
    return 0.0


def _connect(srv: ServerThread) -> socket.socket:
    sock = socket.create_connection((srv.host, srv.port), timeout=10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # connected, says nothing
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n",  # headers never end
        b"GET /v1/mod",  # request line never ends
    ],
)
def test_unfinished_headers_are_dropped_after_the_header_timeout(
    server: ServerThread, sent: bytes
) -> None:
    sock = _connect(server)
    sock.sendall(sent)
    started = time.monotonic()
    reply = _read_all(sock)  # returns when the server closes
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert time.monotonic() - started >= LIMITS.header_timeout_s * 0.9
    sock.close()


def test_an_unfinished_body_is_dropped_after_the_body_timeout(server: ServerThread) -> None:
    sock = _connect(server)
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    sock.sendall(
        head + b"content-length: 500\r\n\r\n" + b'{"prompt": "hello", "max_tokens": 1'[:41]
    )
    reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408 ")
    sock.close()
    # Counted as the gateway's own answers are, under the path it was sent to.
    assert _count(server, "/v1/completions", 408) >= 1


def test_a_pause_shorter_than_the_timeout_is_fine(server: ServerThread) -> None:
    body = b'{"prompt": "hello", "max_tokens": 2}'
    sock = _connect(server)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
        + body[:10]
    )
    time.sleep(LIMITS.body_timeout_s / 3)
    sock.sendall(body[10:])
    reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
    sock.close()


def test_many_slow_connections_are_all_released(server: ServerThread) -> None:
    socks = [_connect(server) for _ in range(100)]
    for s in socks:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\ncontent-length: 500\r\n\r\n{")
    for s in socks:
        assert _read_all(s).startswith(b"HTTP/1.1 408 ")
        s.close()
    assert httpx.get(server.url + "/live").status_code == 200


@pytest.mark.parametrize("one_header", [True, False])
def test_an_over_size_header_block_is_a_431_read_no_further(
    server: ServerThread, one_header: bool
) -> None:
    sock = _connect(server)
    sock.settimeout(10)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n")
    piece = b"x-a: " + b"a" * 4000 + b"\r\n" if not one_header else b"a" * 4096
    if one_header:
        sock.sendall(b"x-big: ")
    sent = 0
    # A 64 MB flood: the server answers and closes long before it would be read.
    try:
        while sent < 64 << 20:
            sock.sendall(piece * 16)
            sent += len(piece) * 16
    except OSError:
        pass  # closed by the server (reset or broken pipe): it stopped reading
    reply = b""
    with contextlib.suppress(OSError):
        reply = _read_all(sock)
    sock.close()
    assert sent < 16 << 20, sent  # socket buffers, not the 64 MB the client offered
    if reply:
        assert reply.startswith(b"HTTP/1.1 431 ")
    assert httpx.get(server.url + "/live").status_code == 200


def test_a_header_block_just_over_the_limit_gets_431(server: ServerThread) -> None:
    before = _count(server, "other", 431) + _count(server, "/v1/models", 431)
    resp = httpx.get(server.url + "/v1/models", headers={"x-pad": "p" * 9000})
    assert resp.status_code == 431
    after = _count(server, "other", 431) + _count(server, "/v1/models", 431)
    assert after == before + 1
    ok = httpx.get(server.url + "/v1/models", headers={"x-pad": "p" * 4000})
    assert ok.status_code == 200


def test_keep_alive_requests_stay_served(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url) as client:
        for _ in range(3):
            assert client.get("/v1/models").status_code == 200
            time.sleep(LIMITS.header_timeout_s * 1.5)  # idle between requests: keep-alive's
        resp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 200


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="header_timeout_s"):
        HttpLimits(header_timeout_s=0)
    with pytest.raises(ValueError, match="max_header_bytes"):
        HttpLimits(max_header_bytes=10)
