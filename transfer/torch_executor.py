"""GPU backend: point-to-point sends through torch.distributed (NCCL on GPUs; gloo runs
the same code on CPUs, which is how it is tested without a GPU).

One process per plan device. Pieces move in *waves*: a piece goes in the wave after the
parent piece it forwards arrived, and each wave is one `batch_isend_irecv` on every rank.
Waves keep NCCL's in-order matching between a pair of ranks deadlock-free while a chain
still forwards piece i while receiving piece i+1.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from wasma.transfer.executor import ExecutionResult, Executor, TransferFailed, pattern
from wasma.transfer.plan import Hop, TransferPlan, check_plan

BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class PieceOp:
    wave: int
    hop: int
    lo: int
    hi: int


def schedule_waves(hops: tuple[Hop, ...]) -> list[list[PieceOp]]:
    """Per hop, its pieces with the wave each moves in.

    A piece moves one wave after the parent piece holding its last byte, after the hop's
    previous piece, and after every hop of earlier rounds."""
    waves: list[list[PieceOp]] = []
    stage_end: dict[int, int] = {}
    for index, hop in enumerate(hops):
        floor = max((w for s, w in stage_end.items() if s < hop.stage), default=-1) + 1
        parent_ops = waves[hop.after] if hop.after is not None else []
        ops: list[PieceOp] = []
        cursor = 0
        previous = floor - 1
        for lo, hi in hop.chunk_bounds():
            wave = max(floor, previous + 1)
            if parent_ops:
                while parent_ops[cursor].hi < hi:
                    cursor += 1
                wave = max(wave, parent_ops[cursor].wave + 1)
            ops.append(PieceOp(wave, index, lo, hi))
            previous = wave
        waves.append(ops)
        if ops:
            stage_end[hop.stage] = max(stage_end.get(hop.stage, 0), ops[-1].wave)
    return waves


def torch_available(backend: str = "nccl") -> bool:
    """Whether this machine can run `backend` (NCCL needs at least two GPUs here, one per
    rank, and the torch build must have it)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return False
    if not dist.is_available():
        return False
    if backend == "gloo":
        return bool(dist.is_gloo_available())
    return bool(dist.is_nccl_available() and torch.cuda.device_count() >= 2)


class TorchDistExecutor(Executor):
    """Runs plans with torch.distributed point-to-point ops, one rank per device.

    `gpu_of` maps plan devices to CUDA devices (default: rank order over visible GPUs);
    with gloo, buffers live in host memory."""

    name = "torch"

    def __init__(
        self,
        backend: str = "nccl",
        *,
        gpu_of: Mapping[str, int] | None = None,
        crash_hop: int | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}")
        if not torch_available(backend):
            raise RuntimeError(f"torch.distributed backend {backend!r} is not usable here")
        self.backend = backend
        self.gpu_of = dict(gpu_of or {})
        self.crash_hop = crash_hop
        self.name = f"torch-{backend}"

    def run(
        self,
        plan: TransferPlan,
        payload: bytes | memoryview | np.ndarray | None = None,
        *,
        timeout_s: float = 120.0,
    ) -> ExecutionResult:
        check_plan(plan)
        data = pattern(plan.bytes) if payload is None else np.frombuffer(payload, np.uint8)
        if data.size != plan.bytes:
            raise ValueError(f"payload has {data.size} bytes, the plan moves {plan.bytes}")
        if not plan.hops:
            return ExecutionResult(plan, self.name, 0.0, (), True)
        devices = plan.devices
        # Spawn, never fork: CUDA cannot be forked, and a fork of a process whose torch
        # (OpenMP) or vLLM threads are running can deadlock in the child.
        ctx: Any = mp.get_context("spawn")
        results: Any = ctx.Queue()
        port = _free_port()
        gpu_of = {d: self.gpu_of.get(d, i) for i, d in enumerate(devices)}
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    self.backend,
                    port,
                    rank,
                    devices,
                    plan,
                    data,
                    gpu_of[device],
                    timeout_s,
                    self.crash_hop,
                    results,
                ),
                daemon=True,
            )
            for rank, device in enumerate(devices)
        ]
        try:
            for proc in procs:
                proc.start()
            reports: list[dict[str, Any]] = []
            deadline = time.monotonic() + timeout_s + 60
            while len(reports) < len(procs):
                try:
                    reports.append(results.get(timeout=0.5))
                except queue.Empty:
                    dead = [p for p in procs if not p.is_alive() and p.exitcode]
                    if dead:
                        raise TransferFailed(
                            f"rank process died (exit {dead[0].exitcode})"
                        ) from None
                    if time.monotonic() > deadline:
                        raise TransferFailed("transfer timed out") from None
                if reports and reports[-1].get("error"):
                    raise TransferFailed(reports[-1]["error"])
            for proc in procs:
                proc.join(timeout=30)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
                    proc.join(timeout=5)
        start = min(r["start"] for r in reports)
        finish = [0.0] * len(plan.hops)
        for report in reports:
            for hop, when in report["finish"].items():
                finish[hop] = when - start
        verified = all(r["verified"] for r in reports)
        return ExecutionResult(plan, self.name, max(finish), tuple(finish), verified)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(
    backend: str,
    port: int,
    rank: int,
    devices: list[str],
    plan: TransferPlan,
    data: np.ndarray,
    gpu: int,
    timeout_s: float,
    crash_hop: int | None,
    results: Any,
) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    me = devices[rank]
    try:
        if backend == "nccl":
            torch.cuda.set_device(gpu)
            device = torch.device("cuda", gpu)
        else:
            device = torch.device("cpu")
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=len(devices),
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        rank_of = {d: i for i, d in enumerate(devices)}
        buffer = torch.zeros(plan.bytes, dtype=torch.uint8, device=device)
        for lo, hi in plan.holdings(me):
            buffer[lo:hi].copy_(torch.from_numpy(data[lo:hi]))
        schedule = schedule_waves(plan.hops)
        mine: dict[int, list[tuple[str, PieceOp]]] = {}
        for index, hop in enumerate(plan.hops):
            role = "send" if hop.src == me else "recv" if hop.dst == me else ""
            if role:
                for op in schedule[index]:
                    mine.setdefault(op.wave, []).append((role, op))
        dist.barrier()  # also brings NCCL communicators up before the clock starts
        _sync(torch, device)
        start = time.perf_counter()
        finish: dict[int, float] = {}
        for wave in sorted(mine):
            ops = []
            for role, op in mine[wave]:
                hop = plan.hops[op.hop]
                peer = rank_of[hop.dst] if role == "send" else rank_of[hop.src]
                fn = dist.isend if role == "send" else dist.irecv
                ops.append(dist.P2POp(fn, buffer[op.lo : op.hi], peer))
            for request in dist.batch_isend_irecv(ops):
                request.wait()
            _sync(torch, device)
            now = time.perf_counter()
            for role, op in mine[wave]:
                if role == "send" and op.hop == crash_hop:
                    os._exit(3)  # fault injection: die like a killed peer
                if (
                    role == "recv"
                    and op.hi == plan.hops[op.hop].offset_bytes + plan.hops[op.hop].num_bytes
                ):
                    finish[op.hop] = now
        verified = True
        for lo, hi in plan.wants(me):
            verified = verified and bool(
                torch.equal(buffer[lo:hi].cpu(), torch.from_numpy(data[lo:hi]))
            )
        results.put({"rank": rank, "start": start, "finish": finish, "verified": verified})
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        results.put({"rank": rank, "error": f"{me}: {traceback.format_exc(limit=4)}"})
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
