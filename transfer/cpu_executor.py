"""CPU backend: one OS process per device, moving bytes between their buffers.

Within a host a hop is a copy between shared-memory buffers (`multiprocessing.
shared_memory`), done by the receiving process; across hosts it is a TCP stream (loopback
when the "hosts" are emulated on one machine). Hops move their range piece by piece and
a forwarding hop sends piece i as soon as it has arrived, while piece i+1 is still coming:
a chain broadcast pipelines.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.synchronize as mpsync
import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from transfer.executor import ExecutionResult, Executor, TransferFailed, pattern
from transfer.plan import Hop, TransferPlan
from transfer.topology import Topology

PAGE_BYTES = 4096
TRANSPORTS = ("auto", "shm", "tcp")


@dataclass
class _Shared:
    """Everything the worker processes inherit through fork."""

    hops: tuple[Hop, ...]
    transport: tuple[str, ...]  # per hop: "shm" or "tcp"
    buffers: dict[str, shared_memory.SharedMemory]
    edges: dict[tuple[int, int], mpsync.Semaphore]  # (parent hop, child hop) -> pieces ready
    stage_go: dict[int, mpsync.Event]
    done: mpsync.Semaphore
    barrier: mpsync.Barrier
    started: Any  # shared double array, one per worker
    finish: Any  # shared double array, one per hop
    errors: Any  # multiprocessing queue of error strings
    listeners: dict[int, socket.socket]  # tcp hop -> listening socket on the receiver
    timeout_s: float
    crash_hop: int | None


class CpuExecutor(Executor):
    """Runs plans between processes on this machine.

    Devices map to hosts through `topology` (or the `nX.` prefix of their names); hops
    between hosts use TCP, hops within one use shared memory. `transport` forces one."""

    name = "cpu"

    def __init__(
        self,
        topology: Topology | None = None,
        *,
        transport: str = "auto",
        hosts: Mapping[str, str] | None = None,
        crash_hop: int | None = None,
    ) -> None:
        """`crash_hop` is fault injection: the process sending that hop dies after its
        first piece, as a peer that fails mid-transfer would."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}")
        self.topology = topology
        self.transport = transport
        self._hosts = dict(hosts or {})
        self.crash_hop = crash_hop
        # Fork: workers inherit buffers, semaphores and sockets without pickling, and start
        # in milliseconds. The parent must not hold locks across run(); it does not.
        self._ctx = mp.get_context("fork")

    def host_of(self, device: str) -> str:
        if device in self._hosts:
            return self._hosts[device]
        if self.topology is not None and device in self.topology:
            return self.topology.host_of(device)
        return device.split(".", 1)[0]

    def _hop_transport(self, hop: Hop) -> str:
        if self.transport != "auto":
            return self.transport
        return "shm" if self.host_of(hop.src) == self.host_of(hop.dst) else "tcp"

    def run(
        self,
        plan: TransferPlan,
        payload: bytes | memoryview | np.ndarray | None = None,
        *,
        timeout_s: float = 120.0,
    ) -> ExecutionResult:
        data = pattern(plan.bytes) if payload is None else np.frombuffer(payload, np.uint8)
        if data.size != plan.bytes:
            raise ValueError(f"payload has {data.size} bytes, the plan moves {plan.bytes}")
        if not plan.hops:
            return ExecutionResult(plan, self.name, 0.0, (), True)
        ctx = self._ctx
        devices = plan.devices
        buffers: dict[str, shared_memory.SharedMemory] = {}
        listeners: dict[int, socket.socket] = {}
        workers: list[Any] = []
        try:
            for device in devices:
                buffers[device] = shared_memory.SharedMemory(create=True, size=max(1, plan.bytes))
                view = np.ndarray((plan.bytes,), np.uint8, buffers[device].buf)
                # Write every page now so no page fault lands inside the timed transfer.
                view[:] = data if device == plan.src else 0
            transports = tuple(self._hop_transport(h) for h in plan.hops)
            for index, kind in enumerate(transports):
                if kind == "tcp":
                    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    listener.bind(("127.0.0.1", 0))
                    listener.listen(1)
                    listeners[index] = listener
            edges = {
                (hop.after, index): ctx.Semaphore(0)
                for index, hop in enumerate(plan.hops)
                if hop.after is not None
            }
            stages = sorted({h.stage for h in plan.hops})
            shared = _Shared(
                hops=plan.hops,
                transport=transports,
                buffers=buffers,
                edges=edges,
                stage_go={s: ctx.Event() for s in stages},
                done=ctx.Semaphore(0),
                barrier=ctx.Barrier(len(devices) + 1),
                started=ctx.Array("d", len(devices), lock=False),
                finish=ctx.Array("d", len(plan.hops), lock=False),
                errors=ctx.Queue(),
                listeners=listeners,
                timeout_s=timeout_s,
                crash_hop=self.crash_hop,
            )
            for rank, device in enumerate(devices):
                proc = ctx.Process(
                    target=_worker,
                    args=(shared, rank, device, plan.bytes),
                    name=f"wasma-transfer-{device}",
                    daemon=True,
                )
                proc.start()
                workers.append(proc)
            for listener in listeners.values():
                listener.close()  # the receiving worker holds its own copy
            _wait_barrier(shared)
            start = time.perf_counter()
            self._drive_stages(shared, stages, workers, deadline=start + timeout_s)
            for proc in workers:
                proc.join(timeout=max(1.0, timeout_s))
            error = _first_error(shared)
            if error:
                raise TransferFailed(error)
            begin = min([start, *shared.started])
            hop_finish = tuple(f - begin for f in shared.finish)
            source = np.ndarray((plan.bytes,), np.uint8, buffers[plan.src].buf)
            verified = all(
                np.array_equal(np.ndarray((plan.bytes,), np.uint8, buffers[d].buf), source)
                for d in plan.dsts
            )
            del source
            return ExecutionResult(plan, self.name, max(hop_finish), hop_finish, verified)
        finally:
            for proc in workers:
                if proc.is_alive():
                    proc.terminate()
                    proc.join(timeout=5)
            for listener in listeners.values():
                listener.close()
            for shm in buffers.values():
                shm.close()
                with contextlib.suppress(FileNotFoundError):
                    shm.unlink()

    def _drive_stages(
        self, shared: _Shared, stages: list[int], workers: list[Any], deadline: float
    ) -> None:
        """Open round s+1 once every hop of rounds <= s reported done."""
        per_stage = {s: sum(1 for h in shared.hops if h.stage == s) for s in stages}
        for s in stages:
            shared.stage_go[s].set()
            for _ in range(per_stage[s]):
                while not shared.done.acquire(timeout=0.2):
                    error = _first_error(shared)
                    if error:
                        raise TransferFailed(error)
                    if any(not p.is_alive() and p.exitcode for p in workers):
                        dead = [p.name for p in workers if not p.is_alive() and p.exitcode]
                        raise TransferFailed(f"transfer worker(s) died: {', '.join(dead)}")
                    if time.perf_counter() > deadline:
                        raise TransferFailed("transfer timed out")


def _wait_barrier(shared: _Shared) -> None:
    try:
        shared.barrier.wait(timeout=max(30.0, shared.timeout_s))
    except threading.BrokenBarrierError:
        error = _first_error(shared)
        raise TransferFailed(error or "transfer workers failed to start") from None


def _first_error(shared: _Shared) -> str:
    try:
        return str(shared.errors.get_nowait())
    except queue.Empty:
        return ""


# worker side --------------------------------------------------------------------------
def _worker(shared: _Shared, rank: int, device: str, num_bytes: int) -> None:
    try:
        views = {
            d: np.ndarray((num_bytes,), np.uint8, shm.buf) for d, shm in shared.buffers.items()
        }
        tasks: list[Callable[[], None]] = []
        ready: list[Callable[[], None]] = []
        for index, hop in enumerate(shared.hops):
            if hop.dst == device and shared.transport[index] == "shm":
                _touch(views[hop.src])  # map the source's pages before the clock starts
                tasks.append(_shm_receive(shared, index, views))
            elif hop.dst == device:
                accept, run = _tcp_receive(shared, index, views[device])
                ready.append(accept)
                tasks.append(run)
            elif hop.src == device and shared.transport[index] == "tcp":
                connect, run = _tcp_send(shared, index, views[device])
                ready.append(connect)
                tasks.append(run)
        _touch(views[device])
        # Receivers accept while senders connect: set connections up in threads before
        # the common start, so no handshake is timed.
        setups = [threading.Thread(target=fn, daemon=True) for fn in ready]
        for t in setups:
            t.start()
        for t in setups:
            t.join()
        shared.barrier.wait(timeout=max(30.0, shared.timeout_s))
        shared.started[rank] = time.perf_counter()
        failures: list[str] = []

        def guarded(task: Callable[[], None]) -> None:
            try:
                task()
            except BaseException:  # report any failure to the parent, then stop
                failures.append(f"{device}: {traceback.format_exc(limit=3)}")

        threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in tasks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            shared.errors.put(failures[0])
            os._exit(1)
    except BaseException:
        shared.errors.put(f"{device}: {traceback.format_exc(limit=3)}")
        shared.barrier.abort()
        os._exit(1)


def _touch(view: np.ndarray) -> None:
    if view.size:
        int(view[::PAGE_BYTES].sum())


class _PieceGate:
    """Tracks how many of the parent hop's pieces have arrived at this hop's sender."""

    def __init__(self, shared: _Shared, index: int) -> None:
        hop = shared.hops[index]
        self.timeout_s = shared.timeout_s
        self.stage_go = shared.stage_go[hop.stage]
        self.edge = shared.edges.get((hop.after, index)) if hop.after is not None else None
        parent = shared.hops[hop.after] if hop.after is not None else None
        self.parent_ends = [hi for _, hi in parent.chunk_bounds()] if parent else []
        self.have = 0

    def wait_round(self) -> None:
        if not self.stage_go.wait(self.timeout_s):
            raise TimeoutError("round never opened")

    def wait_for(self, end: int) -> None:
        """Block until the parent has delivered bytes up to `end`."""
        if self.edge is None:
            return
        while self.have < len(self.parent_ends) and (
            self.have == 0 or self.parent_ends[self.have - 1] < end
        ):
            if not self.edge.acquire(timeout=self.timeout_s):
                raise TimeoutError("upstream piece never arrived")
            self.have += 1


def _maybe_crash(shared: _Shared, index: int, piece_start: int) -> None:
    if shared.crash_hop == index and piece_start == shared.hops[index].offset_bytes:
        os._exit(3)  # die without cleanup, like a killed peer


def _children(shared: _Shared, index: int) -> list[mpsync.Semaphore]:
    return [sem for (parent, _), sem in shared.edges.items() if parent == index]


def _shm_receive(shared: _Shared, index: int, views: dict[str, np.ndarray]) -> Callable[[], None]:
    hop = shared.hops[index]
    gate = _PieceGate(shared, index)
    children = _children(shared, index)
    source, target = views[hop.src], views[hop.dst]

    def run() -> None:
        gate.wait_round()
        for lo, hi in hop.chunk_bounds():
            gate.wait_for(hi)
            np.copyto(target[lo:hi], source[lo:hi])
            _maybe_crash(shared, index, lo)
            for sem in children:
                sem.release()
        shared.finish[index] = time.perf_counter()
        shared.done.release()

    return run


def _tcp_receive(
    shared: _Shared, index: int, target: np.ndarray
) -> tuple[Callable[[], None], Callable[[], None]]:
    hop = shared.hops[index]
    children = _children(shared, index)
    box: list[socket.socket] = []
    listener = shared.listeners[index]

    def accept() -> None:
        listener.settimeout(shared.timeout_s)
        conn, _ = listener.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        box.append(conn)
        listener.close()

    def run() -> None:
        conn = box[0]
        conn.settimeout(shared.timeout_s)
        memory = memoryview(target.data)
        for lo, hi in hop.chunk_bounds():
            got = lo
            while got < hi:
                n = conn.recv_into(memory[got:hi], hi - got)
                if n == 0:
                    raise ConnectionError(f"{hop.src} closed the stream at byte {got}")
                got += n
            for sem in children:
                sem.release()
        conn.close()
        shared.finish[index] = time.perf_counter()
        shared.done.release()

    return accept, run


def _tcp_send(
    shared: _Shared, index: int, source: np.ndarray
) -> tuple[Callable[[], None], Callable[[], None]]:
    hop = shared.hops[index]
    gate = _PieceGate(shared, index)
    box: list[socket.socket] = []
    port = shared.listeners[index].getsockname()[1]

    def connect() -> None:
        conn = socket.create_connection(("127.0.0.1", port), timeout=shared.timeout_s)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        box.append(conn)

    def run() -> None:
        conn = box[0]
        memory = memoryview(source.data)
        gate.wait_round()
        for lo, hi in hop.chunk_bounds():
            gate.wait_for(hi)
            conn.sendall(memory[lo:hi])
            _maybe_crash(shared, index, lo)
        conn.shutdown(socket.SHUT_WR)
        conn.close()

    return connect, run
