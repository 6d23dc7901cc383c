"""CPU backend: one OS process per device, moving bytes between their buffers.

Within a host a hop is a copy between shared-memory buffers, done by the receiving
process; across hosts it is a TCP stream (loopback when the "hosts" are emulated on one
machine). Hops move their range piece by piece and a forwarding hop sends piece i as soon
as it has arrived, while piece i+1 is still coming: a chain broadcast pipelines.

Like NCCL's registered buffers, the worker processes and their buffers are set up once
per executor and reused by every run: each device owns a shared-memory buffer whose pages
are faulted in once and stay mapped in every worker, and each worker waits between runs
for its next job. A run then only fills the source buffer (and overwrites the
destinations, so stale bytes from an earlier run cannot pass verification), hands each
worker its hops and times the copies themselves: no segment creation, page faults, fork or
process exit lands inside (or, on a machine with few cores, beside) the timed transfer.
`close()` (or dropping the executor) stops the workers and frees the buffers.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing as mp
import multiprocessing.synchronize as mpsync
import os
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from wasma.transfer.executor import ExecutionResult, Executor, TransferFailed, pattern
from wasma.transfer.plan import Hop, TransferPlan
from wasma.transfer.topology import Topology

PAGE_BYTES = 4096
TRANSPORTS = ("auto", "shm", "tcp")
# Signals (edges between hops, round openings) come from a bank of semaphores created
# with the workers; a plan that needs more rebuilds the pool with a bigger bank.
_MIN_SEMAPHORES = 64
_POLL_S = 0.2  # how often a waiting parent checks for dead or failed workers


@dataclass(frozen=True)
class _Job:
    """One run, as a worker sees it (pickled down the worker's pipe)."""

    hops: tuple[Hop, ...]
    transport: tuple[str, ...]  # per hop: "shm" or "tcp"
    edges: dict[tuple[int, int], int]  # (parent hop, child hop) -> semaphore: pieces ready
    stage_go: dict[int, int]  # round -> semaphore, released once per hop of the round
    num_bytes: int
    timeout_s: float
    crash_hop: int | None


class _Pool:
    """Worker processes, one per device, with registered buffers and signals.

    Everything here is created before the fork, so workers inherit the buffers, the
    semaphores and their pipe end without pickling."""

    def __init__(self, ctx: Any, devices: tuple[str, ...], capacity: int, semaphores: int) -> None:
        self.devices = devices
        self.capacity = capacity
        self.buffers: dict[str, mmap.mmap] = {}
        self.views: dict[str, np.ndarray] = {}
        self.workers: dict[str, Any] = {}
        self.conns: dict[str, Connection] = {}
        self._child_conns: dict[str, Connection] = {}
        for device in devices:
            # Anonymous shared memory: inherited through fork, gone with the last process.
            buffer = mmap.mmap(-1, capacity)
            view = np.ndarray((capacity,), np.uint8, buffer)
            view[:] = 0  # allocate every page once, here, not during a run
            self.buffers[device] = buffer
            self.views[device] = view
        self.sems: list[mpsync.Semaphore] = [ctx.Semaphore(0) for _ in range(semaphores)]
        self.ready = ctx.Semaphore(0)
        self.done = ctx.Semaphore(0)
        self.finish = ctx.Array("d", semaphores, lock=False)  # per hop, perf_counter
        self.ports = ctx.Array("i", semaphores, lock=False)  # per tcp hop, receiver's port
        for device in devices:
            self.conns[device], self._child_conns[device] = ctx.Pipe(duplex=True)
        try:
            for device in devices:
                proc = ctx.Process(
                    target=_serve,
                    args=(self, device),
                    name=f"wasma-transfer-{device}",
                    daemon=True,
                )
                proc.start()
                self.workers[device] = proc
        finally:
            for conn in self._child_conns.values():
                conn.close()  # the workers hold theirs; EOF then tells them we are gone

    def fits(self, devices: list[str], num_bytes: int, semaphores: int) -> bool:
        return (
            set(devices) <= set(self.devices)
            and num_bytes <= self.capacity
            and semaphores <= len(self.sems)
            and all(p.is_alive() for p in self.workers.values())
        )

    def shutdown(self) -> None:
        for conn in self.conns.values():
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
        for proc in self.workers.values():
            proc.join(timeout=2)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self.conns.values():
            conn.close()
        self.views.clear()
        for buffer in self.buffers.values():
            with contextlib.suppress(BufferError):
                buffer.close()


class CpuExecutor(Executor):
    """Runs plans between processes on this machine.

    Devices map to hosts through `topology` (or the `nX.` prefix of their names); hops
    between hosts use TCP, hops within one use shared memory. `transport` forces one.
    Worker processes and buffers persist between runs (see the module docstring)."""

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
        # Fork: workers inherit buffers, semaphores and pipes without pickling. The
        # parent must not hold locks while it forks; it forks only in _ensure_pool.
        self._ctx = mp.get_context("fork")
        self._pool: _Pool | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._pattern: np.ndarray | None = None
        self._scratch: np.ndarray | None = None

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

    def close(self) -> None:
        """Stop the workers and free the registered buffers (a later run starts anew)."""
        if self._finalizer is not None:
            self._finalizer()
        self._pool = self._finalizer = None

    def _ensure_pool(self, devices: list[str], num_bytes: int, semaphores: int) -> _Pool:
        pool = self._pool
        if pool is not None and pool.fits(devices, num_bytes, semaphores):
            return pool
        known = pool.devices if pool is not None else ()
        capacity = max(num_bytes, pool.capacity if pool is not None else 0, 1)
        bank = max(semaphores, len(pool.sems) if pool is not None else 0, _MIN_SEMAPHORES)
        self.close()
        pool = _Pool(self._ctx, tuple(dict.fromkeys([*known, *devices])), capacity, bank)
        self._pool = pool
        self._finalizer = weakref.finalize(self, pool.shutdown)
        return pool

    def _payload(self, plan: TransferPlan, payload: Any) -> np.ndarray:
        if payload is not None:
            return np.frombuffer(payload, np.uint8)
        if self._pattern is None or self._pattern.size != plan.bytes:
            self._pattern = pattern(plan.bytes)  # seconds for big plans: made once per size
        return self._pattern

    def _evict_caches(self) -> None:
        """Push the fill out of the CPU caches: KV bytes to move were written long before,
        and a small payload just written would otherwise copy from the last-level cache,
        faster than any real transfer of it (and faster per byte than a large one)."""
        if self._scratch is None:
            self._scratch = np.ones(2 * _last_level_cache_bytes(), np.uint8)
        int(self._scratch[::64].sum())  # one read per cache line

    def run(
        self,
        plan: TransferPlan,
        payload: bytes | memoryview | np.ndarray | None = None,
        *,
        timeout_s: float = 120.0,
    ) -> ExecutionResult:
        data = self._payload(plan, payload)
        if data.size != plan.bytes:
            raise ValueError(f"payload has {data.size} bytes, the plan moves {plan.bytes}")
        if not plan.hops:
            return ExecutionResult(plan, self.name, 0.0, (), True)
        hops = plan.hops
        edges: dict[tuple[int, int], int] = {}
        for index, hop in enumerate(hops):
            if hop.after is not None:
                edges[hop.after, index] = len(edges)
        stages = sorted({h.stage for h in hops})
        stage_go = {s: len(edges) + n for n, s in enumerate(stages)}
        needed = max(len(edges) + len(stages), len(hops))
        devices = plan.devices
        pool = self._ensure_pool(devices, plan.bytes, needed)
        n = plan.bytes
        try:
            # Fill outside the timed region: the holders get the payload, everyone else
            # its complement, so a byte a plan fails to deliver cannot match by accident.
            # (A gather's holders get only their parts.)
            for device in devices:
                np.invert(data, out=pool.views[device][:n])
                for lo, hi in plan.holdings(device):
                    pool.views[device][lo:hi] = data[lo:hi]
            self._evict_caches()
            for sem in pool.sems[:needed]:
                while sem.acquire(False):  # a run may leave releases nobody waited for
                    pass
            for index in range(len(hops)):
                pool.finish[index] = 0.0
                pool.ports[index] = 0
            job = _Job(
                hops=hops,
                transport=tuple(self._hop_transport(h) for h in hops),
                edges=edges,
                stage_go=stage_go,
                num_bytes=n,
                timeout_s=timeout_s,
                crash_hop=self.crash_hop,
            )
            involved = [d for d in devices if any(_has_task(job, i, d) for i in range(len(hops)))]
            for device in involved:
                pool.conns[device].send(job)
            watch = _Watch(pool, involved, time.perf_counter() + max(30.0, timeout_s))
            for _ in involved:
                watch.wait(pool.ready, "transfer workers failed to start")
            start = time.perf_counter()
            watch.deadline = start + timeout_s
            for s in stages:  # open round s+1 once every hop of rounds <= s is done
                count = sum(1 for h in hops if h.stage == s)
                for _ in range(count):
                    pool.sems[stage_go[s]].release()
                for _ in range(count):
                    watch.wait(pool.done, "transfer timed out")
            watch.replies()
            hop_finish = tuple(pool.finish[i] - start for i in range(len(hops)))
        except BaseException:
            self.close()  # workers may be mid-hop or dead: start clean next time
            raise
        verified = all(
            np.array_equal(pool.views[d][lo:hi], data[lo:hi])
            for d in plan.receivers
            for lo, hi in plan.wants(d)
        )
        return ExecutionResult(plan, self.name, max(hop_finish), hop_finish, verified)


def _last_level_cache_bytes() -> int:
    """The largest CPU cache, from sysfs; 64 MiB (more than most have) where it is unknown."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = entry.read_text().strip().upper()
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=64 << 20)


def _has_task(job: _Job, index: int, device: str) -> bool:
    hop = job.hops[index]
    return hop.dst == device or (hop.src == device and job.transport[index] == "tcp")


class _Watch:
    """The parent's side of one run: blocks on signals (no spinning), checking now and
    then that no worker failed or died, and collects the workers' end-of-job replies."""

    def __init__(self, pool: _Pool, involved: list[str], deadline: float) -> None:
        self.pool = pool
        self.involved = involved
        self.deadline = deadline
        self.replied: set[str] = set()

    def check(self, devices: list[str] | None = None) -> None:
        for device in self.involved if devices is None else devices:
            conn = self.pool.conns[device]
            proc = self.pool.workers[device]
            if device in self.replied:
                continue
            try:
                kind, message = conn.recv() if conn.poll() else ("", "")
            except (EOFError, OSError):  # it closed its pipe: it is gone
                kind, message = "error", ""
            if kind == "ok":
                self.replied.add(device)
            elif message:
                raise TransferFailed(message)
            elif kind or not proc.is_alive():
                proc.join(timeout=1)
                raise TransferFailed(f"transfer worker died: {proc.name} (exit {proc.exitcode})")

    def wait(self, sem: mpsync.Semaphore, what: str) -> None:
        while not sem.acquire(timeout=_POLL_S):
            self.check()
            if time.perf_counter() > self.deadline:
                raise TransferFailed(what)

    def replies(self) -> None:
        for device in self.involved:
            while device not in self.replied:
                if not self.pool.conns[device].poll(_POLL_S) and (
                    time.perf_counter() > self.deadline
                ):
                    raise TransferFailed("transfer timed out")
                self.check([device])


# worker side --------------------------------------------------------------------------
def _serve(pool: _Pool, device: str) -> None:
    """A worker's life: map every buffer once, then run jobs until told to stop."""
    conn = pool._child_conns[device]
    for other in pool.conns.values():
        other.close()  # parent ends: only the parent may hold them, so EOF works
    for name, child in pool._child_conns.items():
        if name != device:
            child.close()
    views = {d: pool.views[d] for d in pool.devices}
    for view in views.values():
        _touch(view)  # map every page now; they stay mapped for every later run
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        try:
            _run_job(pool, device, views, job)
            conn.send(("ok", None))
        except BaseException:
            with contextlib.suppress(OSError):
                conn.send(("error", f"{device}: {traceback.format_exc(limit=3)}"))
            os._exit(1)


def _run_job(pool: _Pool, device: str, views: dict[str, np.ndarray], job: _Job) -> None:
    tasks: list[Callable[[], None]] = []
    setups: list[Callable[[], None]] = []
    for index, hop in enumerate(job.hops):
        if hop.dst == device and job.transport[index] == "shm":
            tasks.append(_shm_receive(pool, job, index, views))
        elif hop.dst == device:
            accept, run = _tcp_receive(pool, job, index, views[device])
            setups.append(accept)
            tasks.append(run)
        elif hop.src == device and job.transport[index] == "tcp":
            connect, run = _tcp_send(pool, job, index, views[device])
            setups.append(connect)
            tasks.append(run)
    # Receivers accept while senders connect: set connections up before the common
    # start, so no handshake is timed.
    _in_threads(device, setups)
    if len(tasks) == 1:
        pool.ready.release()
        tasks[0]()  # the common case needs no thread
    else:
        _in_threads(device, tasks, before_join=pool.ready.release)


def _in_threads(
    device: str, fns: list[Callable[[], None]], before_join: Callable[[], None] | None = None
) -> None:
    failures: list[str] = []

    def guarded(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException:  # report any failure to the parent, then stop
            failures.append(f"{device}: {traceback.format_exc(limit=3)}")

    threads = [threading.Thread(target=guarded, args=(fn,), daemon=True) for fn in fns]
    for t in threads:
        t.start()
    if before_join is not None:
        before_join()
    for t in threads:
        t.join()
    if failures:
        raise RuntimeError(failures[0])


def _touch(view: np.ndarray) -> None:
    if view.size:
        int(view[::PAGE_BYTES].sum())


class _PieceGate:
    """Tracks how many of the parent hop's pieces have arrived at this hop's sender."""

    def __init__(self, pool: _Pool, job: _Job, index: int) -> None:
        hop = job.hops[index]
        self.timeout_s = job.timeout_s
        self.stage_go = pool.sems[job.stage_go[hop.stage]]
        self.edge = pool.sems[job.edges[hop.after, index]] if hop.after is not None else None
        parent = job.hops[hop.after] if hop.after is not None else None
        self.parent_ends = [hi for _, hi in parent.chunk_bounds()] if parent else []
        self.have = 0

    def wait_round(self) -> None:
        if not self.stage_go.acquire(timeout=self.timeout_s):
            raise TimeoutError("round never opened")

    def wait_for(self, end: int) -> None:
        """Block (sleeping, not spinning) until the parent has delivered bytes up to `end`."""
        if self.edge is None:
            return
        while self.have < len(self.parent_ends) and (
            self.have == 0 or self.parent_ends[self.have - 1] < end
        ):
            if not self.edge.acquire(timeout=self.timeout_s):
                raise TimeoutError("upstream piece never arrived")
            self.have += 1


def _maybe_crash(job: _Job, index: int, piece_start: int) -> None:
    if job.crash_hop == index and piece_start == job.hops[index].offset_bytes:
        os._exit(3)  # die without cleanup, like a killed peer


def _children(pool: _Pool, job: _Job, index: int) -> list[mpsync.Semaphore]:
    return [pool.sems[sem] for (parent, _), sem in job.edges.items() if parent == index]


def _finished(pool: _Pool, index: int) -> None:
    pool.finish[index] = time.perf_counter()
    pool.done.release()


def _shm_receive(
    pool: _Pool, job: _Job, index: int, views: dict[str, np.ndarray]
) -> Callable[[], None]:
    hop = job.hops[index]
    gate = _PieceGate(pool, job, index)
    children = _children(pool, job, index)
    source, target = views[hop.src], views[hop.dst]

    def run() -> None:
        gate.wait_round()
        for lo, hi in hop.chunk_bounds():
            gate.wait_for(hi)
            np.copyto(target[lo:hi], source[lo:hi])
            _maybe_crash(job, index, lo)
            for sem in children:
                sem.release()
        _finished(pool, index)

    return run


def _tcp_receive(
    pool: _Pool, job: _Job, index: int, target: np.ndarray
) -> tuple[Callable[[], None], Callable[[], None]]:
    hop = job.hops[index]
    children = _children(pool, job, index)
    box: list[socket.socket] = []
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    pool.ports[index] = listener.getsockname()[1]  # the sender polls for it

    def accept() -> None:
        try:
            listener.settimeout(job.timeout_s)
            conn, _ = listener.accept()
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            box.append(conn)
        finally:
            listener.close()

    def run() -> None:
        conn = box[0]
        conn.settimeout(job.timeout_s)
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
        _finished(pool, index)

    return accept, run


def _tcp_send(
    pool: _Pool, job: _Job, index: int, source: np.ndarray
) -> tuple[Callable[[], None], Callable[[], None]]:
    hop = job.hops[index]
    gate = _PieceGate(pool, job, index)
    box: list[socket.socket] = []

    def connect() -> None:
        deadline = time.perf_counter() + job.timeout_s
        while not pool.ports[index]:  # set-up only, never timed: the receiver listens
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{hop.dst} never listened")
            time.sleep(0.001)
        conn = socket.create_connection(("127.0.0.1", pool.ports[index]), timeout=job.timeout_s)
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
            _maybe_crash(job, index, lo)
        conn.shutdown(socket.SHUT_WR)
        conn.close()

    return connect, run
