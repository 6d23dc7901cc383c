"""Prefix KV served between engines over TCP: a block store, its server, and a client.

An engine that computed a prompt keeps the KV of the prompt's full blocks in a `PeerStore`
keyed by a block-hash chain (each key covers every block before it, as vLLM's prefix
cache does), and a `PeerServer` answers two questions from other engines: how many
leading blocks of this prompt do you hold (`query`), and send me blocks i..m of them
(`fetch`), streamed layer by layer so the receiver can compute layer j while layer j+1
is still on the wire. Each layer carries a CRC32; a receiver that sees a bad checksum,
a short stream or a dead peer reports the load failed and recomputes instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

KEY_BYTES = 16
_LEN = struct.Struct("!I")
FAULTS = (None, "corrupt", "truncate")


def block_keys(token_ids: Sequence[int], block_size: int) -> list[str]:
    """Chained hex keys of each full block: key i names blocks 0..i together."""
    keys = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = np.asarray(token_ids[start : start + block_size], dtype=np.int64).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=KEY_BYTES).digest()
        keys.append(parent.hex())
    return keys


@dataclass(frozen=True)
class LayerBlocks:
    """One layer's KV for a run of consecutive blocks, as raw bytes plus how to view them."""

    name: str
    dtype: str  # numpy-style name of the element type, e.g. "float32", "bfloat16"
    shape: tuple[int, ...]  # [blocks, ...per-block shape]
    data: bytes

    def header(self, crc: int) -> dict[str, object]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": len(self.data),
            "crc32": crc,
        }


class PeerStore:
    """Saved prefixes, least recently used evicted past `capacity_bytes`."""

    def __init__(self, capacity_bytes: int = 256 << 20) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[int, tuple[list[str], list[LayerBlocks]]] = OrderedDict()
        self._index: dict[str, tuple[int, int]] = {}  # key -> (entry, blocks it covers)
        self._bytes = 0
        self._next = 0
        self._lock = threading.Lock()

    def put(self, keys: Sequence[str], layers: Sequence[LayerBlocks]) -> None:
        """Keep `layers` (each [len(keys), ...]) under the block keys of one prompt."""
        if not keys or not layers:
            return
        if any(layer.shape[0] != len(keys) for layer in layers):
            raise ValueError("every layer needs one row per block key")
        size = sum(len(layer.data) for layer in layers)
        with self._lock:
            if size > self.capacity_bytes:
                return
            entry = self._next
            self._next += 1
            self._entries[entry] = (list(keys), list(layers))
            self._bytes += size
            for count, key in enumerate(keys, start=1):
                current = self._index.get(key)
                # A longer saved prompt covering the same prefix is as good; keep the newest.
                if current is None or current[0] in self._entries:
                    self._index[key] = (entry, count)
            while self._bytes > self.capacity_bytes:
                self._evict_oldest()

    def _evict_oldest(self) -> None:
        entry, (keys, layers) = self._entries.popitem(last=False)
        self._bytes -= sum(len(layer.data) for layer in layers)
        for key in keys:
            if self._index.get(key, (None, 0))[0] == entry:
                del self._index[key]

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """How many leading blocks of a prompt with these chained keys are held."""
        with self._lock:
            for count in range(len(keys), 0, -1):
                if keys[count - 1] in self._index:
                    return count
        return 0

    def blocks(self, key: str, first: int) -> list[LayerBlocks]:
        """Blocks first..n-1 of the prefix named by `key` (which covers n blocks)."""
        with self._lock:
            found = self._index.get(key)
            if found is None:
                raise KeyError(key)
            entry, count = found
            self._entries.move_to_end(entry)
            _, layers = self._entries[entry]
        out = []
        for layer in layers:
            row = len(layer.data) // layer.shape[0]
            out.append(
                LayerBlocks(
                    layer.name,
                    layer.dtype,
                    (count - first, *layer.shape[1:]),
                    layer.data[first * row : count * row],
                )
            )
        return out

    @property
    def nbytes(self) -> int:
        return self._bytes


class PeerServer:
    """Serves a `PeerStore` on a TCP port, one thread per connection."""

    def __init__(
        self,
        store: PeerStore,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        allow_fault_injection: bool = False,
    ) -> None:
        self.store = store
        self.allow_fault_injection = allow_fault_injection
        self.fault: str | None = None  # test hook: "corrupt" or "truncate" the next fetches
        self._sock = socket.create_server((host, port), reuse_port=False)
        host_name, bound_port = self._sock.getsockname()[:2]
        self.address = f"{host_name}:{bound_port}"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="wasma-kv-peer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        # shutdown() wakes the thread blocked in accept(); close() alone would leave the
        # listening socket alive (and accepting) until that call returns.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = _read_json(conn)
                op = request.get("op")
                if op == "query":
                    _write_json(conn, {"blocks": self.store.longest_prefix(request["keys"])})
                elif op == "fetch":
                    self._fetch(conn, str(request["key"]), int(request["first"]))
                elif op == "fault" and self.allow_fault_injection:
                    mode = request.get("mode")
                    self.fault = mode if mode in FAULTS else None
                    _write_json(conn, {"fault": self.fault})
                else:
                    _write_json(conn, {"error": f"unknown op {op!r}"})
            except (OSError, ValueError, KeyError) as exc:
                with contextlib.suppress(OSError):
                    _write_json(conn, {"error": f"{type(exc).__name__}: {exc}"})

    def _fetch(self, conn: socket.socket, key: str, first: int) -> None:
        try:
            layers = self.store.blocks(key, first)
        except KeyError:
            _write_json(conn, {"error": "prefix no longer held"})
            return
        _write_json(conn, {"layers": len(layers)})
        for index, layer in enumerate(layers):
            crc = zlib.crc32(layer.data)
            data = layer.data
            if self.fault == "corrupt" and index == len(layers) - 1 and data:
                data = bytes([data[0] ^ 0xFF]) + data[1:]  # a flipped byte on the wire
            _write_json(conn, layer.header(crc))
            if self.fault == "truncate" and index == len(layers) - 1:
                conn.sendall(data[: len(data) // 2])
                return  # the peer "dies" halfway through its last layer
            conn.sendall(data)


class PeerError(RuntimeError):
    """The peer could not be reached, does not hold the prefix, or sent bad data."""


def query(address: str, keys: Sequence[str], timeout_s: float = 5.0) -> int:
    """Leading blocks of `keys` the peer at host:port holds (0 when unreachable)."""
    return try_query(address, keys, timeout_s) or 0


def try_query(address: str, keys: Sequence[str], timeout_s: float = 5.0) -> int | None:
    """Leading blocks of `keys` the peer at host:port holds; None when it cannot be
    asked (unreachable, or it answered nonsense)."""
    if not keys:
        return 0
    try:
        with _connect(address, timeout_s) as conn:
            _write_json(conn, {"op": "query", "keys": list(keys)})
            return int(_read_json(conn).get("blocks", 0))
    except (OSError, ValueError):
        return None


class PeerBackoff:
    """Peers that could not be asked lately, skipped for `retry_s`: a query runs on
    vLLM's scheduler thread, once a pass for every waiting request naming a peer, so a
    peer whose host stopped answering would otherwise stall the engine a connect
    timeout at a time."""

    def __init__(self, retry_s: float = 10.0) -> None:
        self.retry_s = retry_s
        self._until: dict[str, float] = {}

    def skip(self, peer: str, now: float) -> bool:
        until = self._until.get(peer)
        if until is None:
            return False
        if now >= until:
            del self._until[peer]
            return False
        return True

    def failed(self, peer: str, now: float) -> None:
        self._until[peer] = now + self.retry_s


def fetch(address: str, key: str, first: int, timeout_s: float = 30.0) -> Iterator[LayerBlocks]:
    """Stream blocks first..n-1 of prefix `key` from the peer, one verified layer at a time.

    Raises PeerError on a dead peer, a short stream or a checksum mismatch."""
    try:
        conn = _connect(address, timeout_s)
    except OSError as exc:
        raise PeerError(f"cannot reach KV peer {address}: {exc}") from None
    with conn:
        try:
            _write_json(conn, {"op": "fetch", "key": key, "first": first})
            head = _read_json(conn)
            if "error" in head:
                raise PeerError(f"KV peer {address}: {head['error']}")
            for _ in range(int(head["layers"])):
                header = _read_json(conn)
                data = _read_exact(conn, int(header["nbytes"]))
                if zlib.crc32(data) != int(header["crc32"]):
                    raise PeerError(
                        f"KV from {address} failed its checksum (layer {header['name']})"
                    )
                yield LayerBlocks(
                    str(header["name"]),
                    str(header["dtype"]),
                    tuple(int(d) for d in header["shape"]),
                    data,
                )
        except (OSError, ValueError, KeyError) as exc:
            raise PeerError(f"KV peer {address} failed mid-transfer: {exc}") from None


def set_fault(address: str, mode: str | None) -> None:
    """Test hook: make a peer started with fault injection corrupt or cut its fetches."""
    with _connect(address, 5.0) as conn:
        _write_json(conn, {"op": "fault", "mode": mode})
        reply = _read_json(conn)
    if "error" in reply:
        raise PeerError(str(reply["error"]))


def _connect(address: str, timeout_s: float) -> socket.socket:
    host, _, port = address.rpartition(":")
    conn = socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _write_json(conn: socket.socket, message: dict[str, object]) -> None:
    body = json.dumps(message).encode()
    conn.sendall(_LEN.pack(len(body)) + body)


def _read_json(conn: socket.socket) -> dict[str, Any]:
    (length,) = _LEN.unpack(_read_exact(conn, _LEN.size))
    if length > 1 << 24:
        raise ValueError("oversized control message")
    message = json.loads(_read_exact(conn, length))
    if not isinstance(message, dict):
        raise ValueError("control message must be a JSON object")
    return message


def _read_exact(conn: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = conn.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError(f"stream ended after {got} of {size} bytes")
        got += n
    return bytes(buffer)
