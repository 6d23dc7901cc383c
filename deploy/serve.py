"""`wasma serve`: engines + router (a Ray actor) + the OpenAI gateway under uvicorn.

    wasma serve --engines sim:4 --policy wasma
    wasma serve --engines vllm:2 --model DIR --policy wasma
    wasma serve --engines openai:http://h1:8000,http://h2:8000 --kv-events tcp://h1:5557,...

API keys come from `WASMA_API_KEYS` (comma-separated) or `--api-key-file` (one a line);
with neither, the gateway is open.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Literal, NoReturn

import uvicorn
import yaml
from fastapi import FastAPI

from wasma.deploy.build import (
    EngineSpec,
    RouterActor,
    ServiceConfig,
    build_service,
    free_ports,
    resolve_profile,
)
from wasma.deploy.frontend import Frontend, FrontendError, FrontendOptions
from wasma.deploy.gateway import GatewayConfig, create_admin_app, create_app
from wasma.deploy.http_limits import HttpLimits
from wasma.deploy.lifecycle import DrainingServer, Lifecycle, LifecycleConfig
from wasma.deploy.router_client import LocalRouterClient, RayRouterClient, RouterClient
from wasma.engines.base import DEFAULT_RETAIN_S, MAX_RETAIN_S
from wasma.scheduler.calibration import CalibrationConfig

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    pass


def load_api_keys(path: str | None, env: Mapping[str, str]) -> tuple[str, ...]:
    keys: list[str] = []
    raw = env.get("WASMA_API_KEYS", "")
    keys += [k.strip() for k in raw.split(",") if k.strip()]
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"--api-key-file {path}: {exc.strerror or exc}") from None
        keys += [
            line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")
        ]
    return tuple(dict.fromkeys(keys))


def load_config_file(path: str | None) -> dict[str, Any]:
    """`--config FILE` (YAML): `params` (policy parameters), `sim_speed`,
    `max_outstanding`, `engine_options`, `kv_events`, `kv_transfer` (as `--kv-transfer`),
    `retain_lease_s` (how long engines keep KV the policy retains), `gateway` (GatewayConfig
    fields),
    `reliability` (ServiceConfig's fault-handling fields: `journal`, `request_timeout_s`,
    `health_timeout_s`, `max_failovers`, `router_max_restarts`, `max_hold_s`),
    `calibration` (`false` turns live cost calibration off; a mapping sets
    CalibrationConfig's fields; applied with `--router-in-process`)."""
    if not path:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not UTF-8 text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"--config {path}: invalid YAML{at}: {problem}") from None
    except ValueError as exc:  # a YAML integer too long to read
        raise ConfigError(f"--config {path}: invalid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: must be a mapping")
    known = {
        "policy",
        "params",
        "sim_speed",
        "max_outstanding",
        "engine_options",
        "kv_events",
        "kv_transfer",
        "gateway",
        "reliability",
        "calibration",
        "retain_lease_s",
        "http",
        "lifecycle",
    }
    unknown = set(data) - known
    if unknown:
        raise ConfigError(
            f"--config {path}: unknown key(s) {sorted(unknown, key=str)}; known: {sorted(known)}"
        )
    # The Helm chart writes `policy: {name, params}`; its params are the policy's.
    policy = data.pop("policy", None)
    if policy is not None:
        if not isinstance(policy, dict) or set(policy) - {"name", "params"}:
            raise ConfigError(f"--config {path}: policy must be a mapping of name and params")
        if "params" in data and policy.get("params"):
            raise ConfigError(f"--config {path}: give policy params once, not in both places")
        data["params"] = policy.get("params") or data.get("params", {})
        if policy.get("name"):
            data["policy_name"] = str(policy["name"])
    _check_config_types(data)
    return data


def _check_config_types(data: dict[str, Any]) -> None:
    """Each top-level value of the kind its setting takes, checked before anything
    starts: YAML gives `sim_speed: abc` or `kv_transfer: "false"` without complaint."""

    def fail(key: str, want: str) -> NoReturn:
        raise ConfigError(f"--config {key}: expected {want}, got {data[key]!r}")

    for key in ("params", "engine_options", "gateway", "reliability", "http", "lifecycle"):
        if key in data and not isinstance(data[key], Mapping):
            fail(key, "a mapping")
    if "sim_speed" in data:
        speed = data["sim_speed"]
        if not _is_number(speed) or not 0 < speed <= 1e9:
            fail("sim_speed", "a number > 0")
    if "max_outstanding" in data and not _int_in(data["max_outstanding"], 1, 1 << 40):
        fail("max_outstanding", "an integer >= 1")
    if "kv_transfer" in data and not isinstance(data["kv_transfer"], bool):
        fail("kv_transfer", "true or false")
    if "kv_events" in data:
        events = data["kv_events"]
        if isinstance(events, str):
            events = [e.strip() for e in events.split(",") if e.strip()]
        if not isinstance(events, list) or not all(isinstance(e, str) for e in events):
            fail("kv_events", "a list of endpoints (or one comma-separated string)")
        data["kv_events"] = tuple(events)
    defaults = {f.name: f.default for f in fields(GatewayConfig)}
    for key, value in dict(data.get("gateway") or {}).items():
        default = defaults.get(key)
        if key == "admin_port":
            if value is not None and not _int_in(value, 1, 65535):
                raise ConfigError(f"--config gateway.admin_port: expected a port, got {value!r}")
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"--config gateway.{key}: expected true or false, got {value!r}")
        elif isinstance(default, int) and not _int_in(value, 1, 1 << 40):
            raise ConfigError(f"--config gateway.{key}: expected an integer >= 1, got {value!r}")


def _int_in(value: Any, low: int, high: float) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _remote_model(urls: tuple[str, ...]) -> tuple[list[str], str | None]:
    """Model ids served by the first reachable remote, and a local dir holding it."""
    import httpx

    for url in urls:
        try:
            data = httpx.get(url + "/v1/models", timeout=10).json()
        except Exception:
            continue
        ids = [m.get("id") for m in data.get("data", []) if m.get("id")]
        roots = [m.get("root") or m.get("id") for m in data.get("data", [])]
        local = next((r for r in roots if r and Path(r).is_dir()), None)
        return ids, local
    return [], None


# Where `wasma serve --engines sim:N` writes the tiny model whose tokenizer and chat
# template it renders with (nothing is downloaded).
SIM_MODEL_DIR = "~/.cache/wasma/tiny-model"


def frontend_options(cfg: ServiceConfig, args: argparse.Namespace) -> FrontendOptions:
    """vLLM's front-end flags for this service: the model directory (a remote engine's
    own, a local tiny model for sim engines) and the parsers named as `vllm serve`
    names them."""
    model_dir = cfg.model
    names: list[str] = []
    if cfg.engines.kind == "openai":
        remote, local = _remote_model(cfg.engines.urls)
        names += remote
        model_dir = model_dir or local
        if model_dir is None:
            raise ConfigError(
                "--engines openai: the gateway renders requests with the model's tokenizer "
                "and chat template: pass --model DIR (the directory the servers loaded)"
            )
    if cfg.engines.kind == "sim" and model_dir is None:
        from wasma.engines.tiny_model import write_tiny_model

        model_dir = str(write_tiny_model(str(Path(SIM_MODEL_DIR).expanduser())))
    assert model_dir is not None
    served = getattr(args, "served_model_name", None)
    if served:
        names = [served]
    elif cfg.engines.kind == "sim":
        names = ["wasma-sim"]
    return FrontendOptions(
        model=model_dir,
        served_model_name=tuple(dict.fromkeys(names)),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        chat_template=getattr(args, "chat_template", None),
        enable_auto_tool_choice=bool(getattr(args, "enable_auto_tool_choice", False)),
        max_model_len=getattr(args, "max_model_len", None),
    )


def gateway_setup(
    cfg: ServiceConfig, api_keys: tuple[str, ...], options: FrontendOptions, gw: Mapping[str, Any]
) -> GatewayConfig:
    known = {f.name for f in fields(GatewayConfig)} - {"model_names", "api_keys"}
    unknown = set(gw) - known
    if unknown:
        raise ConfigError(
            f"--config gateway: unknown key(s) {sorted(unknown, key=str)}; known: {sorted(known)}"
        )
    return GatewayConfig(
        model_names=options.served_model_name or (options.model,),
        api_keys=api_keys,
        **dict(gw),
    )


def calibration_setting(data: Any) -> CalibrationConfig | bool | None:
    """The config file's `calibration`: absent (the router decides), a bool, or the
    fields of `CalibrationConfig`."""
    if data is None or isinstance(data, bool):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError("--config calibration: must be true, false or a mapping")
    known = {f.name for f in fields(CalibrationConfig)}
    if set(data) - known:
        raise ConfigError(f"--config calibration: known keys are {sorted(known)}")
    try:
        return CalibrationConfig(**dict(data))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"--config calibration: {exc}") from None


def local_router_factory(
    cfg: ServiceConfig, calibration: CalibrationConfig | bool | None = None
) -> Any:
    async def factory() -> RouterClient:
        service = await build_service(cfg)
        if calibration is not None:
            service.set_calibration(calibration)
        return LocalRouterClient(service)

    return factory


# The Ray namespace shared routers live in: gateways started anywhere in the cluster
# find one by its name there.
SHARED_ROUTER_NAMESPACE = "wasma"


def ray_router_factory(
    cfg: ServiceConfig, shared_name: str | None = None, direct: bool = True
) -> Any:
    """The router as a Ray actor. With `shared_name`, one detached actor of that name
    serves every gateway that names it: the first to start creates it, the others join
    it, so all of them place on one view of workflows, prefixes and loads. `direct`: the
    gateway streams from the engines it can reach itself (deploy/ray_channel.py)."""

    async def factory() -> RouterClient:
        import ray

        actor_cls: Any = ray.remote(RouterActor)
        # An async actor runs its methods as coroutines on one loop; the concurrency cap
        # bounds requests in flight, so set it above the router's own admission limit.
        options: dict[str, Any] = {
            "name": shared_name or "wasma-router",
            "max_concurrency": max((cfg.max_outstanding or 8192) * 2, 1000),
            "num_cpus": 0,
            "get_if_exists": shared_name is not None,
            # Ray brings a dead router back; it replays the journal (registered DAGs and
            # their progress) and requests in flight got a retryable 503 meanwhile.
            "max_restarts": cfg.router_max_restarts,
            "max_task_retries": 0,
        }
        if shared_name is not None:
            # Outlives the gateway that created it: the others still route through it.
            options |= {"namespace": SHARED_ROUTER_NAMESPACE, "lifetime": "detached"}
        handle = actor_cls.options(**options).remote(cfg)
        engines = await handle.start.remote()
        log.info("router actor %s up with engines %s", options["name"], engines)
        if shared_name is not None and len(engines) != cfg.engines.count:
            log.warning(
                "shared router %s has %d engines; this gateway's --engines names %d: "
                "the router's own configuration holds",
                shared_name,
                len(engines),
                cfg.engines.count,
            )
        return RayRouterClient(handle, owns=shared_name is None, direct=direct)

    return factory


def check_engines_answer(urls: Sequence[str], api_key: str | None, timeout_s: float = 10.0) -> None:
    """Fail before anything starts, in one line, where an `openai:` engine does not list
    its models: the router's start would fail on it anyway, deep in a traceback."""
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    for i, url in enumerate(urls):
        where = f"--engines: engine {i} at {url}"
        try:
            resp = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise ConfigError(f"{where} cannot be reached ({exc or type(exc).__name__})") from None
        if resp.status_code != 200:
            raise ConfigError(f"{where} answered GET /v1/models with HTTP {resp.status_code}")


def serve_main(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    spec = EngineSpec.parse(args.engines)
    file_cfg = load_config_file(getattr(args, "config", None))
    kv_events = tuple(
        e.strip() for e in (getattr(args, "kv_events", None) or "").split(",") if e.strip()
    ) or tuple(file_cfg.get("kv_events", ()))
    kv_transfer = bool(getattr(args, "kv_transfer", False) or file_cfg.get("kv_transfer", False))
    if kv_transfer and spec.kind != "vllm":
        raise ConfigError(
            "--kv-transfer needs --engines vllm:N (wasma starts those engines with its KV "
            "connector); for openai: engines, start each vLLM server with the connector"
        )
    cfg = ServiceConfig(
        engines=spec,
        policy=args.policy,
        profile=args.profile,
        model=args.model,
        params=file_cfg.get("params", {}),
        sim_speed=float(getattr(args, "sim_speed", None) or file_cfg.get("sim_speed", 1.0)),
        max_outstanding=file_cfg.get("max_outstanding"),
        kv_events=kv_events,
        kv_transfer=kv_transfer,
        engine_options=_remote_tokens(args, _offloading(args, file_cfg.get("engine_options", {}))),
        retain_lease_s=_lease(file_cfg.get("retain_lease_s", DEFAULT_RETAIN_S)),
        **_reliability(file_cfg.get("reliability") or {}),
    )
    from wasma.scheduler.registry import default_registry

    named = file_cfg.get("policy_name")
    if named and named != cfg.policy:
        raise ConfigError(f"--policy {cfg.policy} disagrees with the config file's {named}")
    if cfg.policy not in default_registry().names():
        raise ConfigError(
            f"unknown policy {cfg.policy!r}; choose from: {', '.join(default_registry().names())}"
        )
    profile = resolve_profile(cfg)  # fail fast on a bad --profile
    try:
        # A bad policy parameter (--config params) fails here, not in the server's startup.
        default_registry().check(cfg.policy, dict(cfg.params), profile)
    except ValueError as exc:
        raise ConfigError(f"--config params: {exc}") from None
    if spec.kind == "vllm" and not cfg.model:
        raise ConfigError("--engines vllm:N needs --model DIR (e.g. from `wasma tiny-model DIR`)")
    if cfg.model and not Path(cfg.model).is_dir():
        raise ConfigError(f"--model {cfg.model}: no such directory")
    if spec.kind == "openai":
        try:
            check_engines_answer(spec.urls, cfg.engine_options.get("api_key"))
        except ConfigError as exc:
            # Not fatal: engines roll out independently of the gateway, which starts,
            # answers 503 + Retry-After and turns ready once they answer (lifecycle.py).
            log.warning("%s; the gateway starts and waits for it", exc)
    limits = _dataclass_from(HttpLimits, file_cfg.get("http") or {}, "http")
    life_cfg = _dataclass_from(LifecycleConfig, file_cfg.get("lifecycle") or {}, "lifecycle")
    lifecycle = Lifecycle(life_cfg)
    keys = load_api_keys(args.api_key_file, os.environ)
    options = frontend_options(cfg, args)
    gcfg = gateway_setup(cfg, keys, options, file_cfg.get("gateway", {}))
    try:
        frontend = asyncio.run(Frontend.build(options))
    except FrontendError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.engines.kind == "sim":
        cfg = replace(cfg, sim_vocab_size=frontend.vocab_size)
    if getattr(args, "router_in_process", False) and getattr(args, "shared_router", None):
        raise ConfigError("--shared-router is a Ray actor: it cannot be --router-in-process")
    if getattr(args, "router_in_process", False):
        factory = local_router_factory(cfg, calibration_setting(file_cfg.get("calibration")))
    else:
        import ray

        if args.address:
            ray.init(address=args.address)
        else:
            ray.init(include_dashboard=False)
        factory = ray_router_factory(
            cfg,
            getattr(args, "shared_router", None),
            direct=not getattr(args, "relay_tokens", False),
        )
    app = create_app(factory, frontend, gcfg, lifecycle)
    # As vLLM's API server does once it is up: the startup heap (vLLM's serving layer,
    # torch, the tokenizer, Ray) is never garbage, so the collector stops walking it.
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()
    if gcfg.admin_port is not None:
        return _serve_two(app, args.host, args.port, gcfg.admin_port, limits, lifecycle)
    log.info(
        "wasma gateway on http://%s:%d (policy %s, engines %s, auth %s)",
        args.host,
        args.port,
        cfg.policy,
        args.engines,
        "on" if keys else "off",
    )
    _server(app, args.host, args.port, limits=limits, lifecycle=lifecycle).run()
    return 0


def _dataclass_from(cls: Any, data: Any, key: str) -> Any:
    """`cls(**data)` for a `--config` section, each mistake a one-line ConfigError."""
    known = {f.name for f in fields(cls)}
    if not isinstance(data, Mapping) or set(data) - known:
        raise ConfigError(f"--config {key}: known keys are {sorted(known)}")
    if not all(_is_number(v) for v in data.values()):
        raise ConfigError(f"--config {key}: every value is a number")
    try:
        return cls(**dict(data))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"--config {key}: {exc}") from None


_RELIABILITY_KEYS: dict[str, Callable[[Any], Any]] = {
    "journal": str,
    "request_timeout_s": float,
    "health_timeout_s": float,
    "max_failovers": lambda v: _count(v, "max_failovers"),
    "router_max_restarts": lambda v: _count(v, "router_max_restarts"),
    "max_hold_s": float,
}


def _count(value: Any, key: str) -> int:
    if not _int_in(value, 0, math.inf):
        raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
    return int(value)


def _remote_tokens(args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    """The engine options with `--remote-tokens` (how `openai:` engines are driven)."""
    mode = getattr(args, "remote_tokens", None)
    if mode is None or mode == "off":
        return options
    if EngineSpec.parse(args.engines).kind != "openai":
        raise ConfigError("--remote-tokens applies to --engines openai:URL[,URL...]")
    return {**options, "tokens_api": None if mode == "auto" else True}


def _offloading(args: argparse.Namespace, options: Mapping[str, Any]) -> dict[str, Any]:
    """The engine options with `--kv-offloading-size` (vLLM's CPU KV tier) applied."""
    gib = getattr(args, "kv_offloading_size", None)
    out = dict(options)
    if gib is None:
        return out
    if getattr(args, "kv_transfer", False):
        raise ConfigError(
            "--kv-offloading-size and --kv-transfer both set vLLM's one kv_transfer_config: "
            "choose one"
        )
    if EngineSpec.parse(args.engines).kind != "vllm":
        raise ConfigError(
            "--kv-offloading-size needs --engines vllm:N (wasma starts those engines); for "
            "openai: engines, start each vLLM server with --kv-offloading-size"
        )
    out["kv_offloading_gib"] = float(gib)
    return out


def _lease(value: Any) -> float:
    try:
        lease = float(value)
    except (TypeError, ValueError):
        lease = float("nan")
    if isinstance(value, bool) or not 0 < lease <= MAX_RETAIN_S:
        raise ConfigError(
            f"--config retain_lease_s: expected seconds in (0, {MAX_RETAIN_S:g}], got {value!r}"
        )
    return lease


def _reliability(data: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(data, Mapping) or set(data) - set(_RELIABILITY_KEYS):
        raise ConfigError(f"--config reliability: known keys are {sorted(_RELIABILITY_KEYS)}")
    try:
        out = {k: _RELIABILITY_KEYS[k](v) for k, v in data.items()}
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"--config reliability: {exc}") from None
    for key, value in out.items():
        if key.endswith("_s") and not (isinstance(value, float) and 0 < value < math.inf):
            raise ConfigError(f"--config reliability.{key}: expected seconds > 0, got {value!r}")
    return out


def _server(
    app: FastAPI,
    host: str,
    port: int,
    lifespan: Literal["auto", "on", "off"] = "auto",
    limits: HttpLimits | None = None,
    lifecycle: Lifecycle | None = None,
    loop: str = "uvloop",
) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop=loop,
        # httptools with read limits: header size and header/body timeouts (http_limits.py).
        http=(limits or HttpLimits()).protocol(getattr(app.state, "http_codes", None)),
        access_log=False,
        log_level="warning",
        timeout_keep_alive=30,
        lifespan=lifespan,
    )
    if lifecycle is None:
        return uvicorn.Server(config)
    return DrainingServer(config, lifecycle)


def _serve_two(
    app: FastAPI,
    host: str,
    port: int,
    admin_port: int,
    limits: HttpLimits | None = None,
    lifecycle: Lifecycle | None = None,
) -> int:
    """The API on `port`, `/health` and `/metrics` on `admin_port`, one process."""
    log.info("wasma gateway on http://%s:%d, health and metrics on port %d", host, port, admin_port)
    main = _server(app, host, port, limits=limits, lifecycle=lifecycle)
    # The admin server keeps answering probes while the main one drains.
    admin = _server(create_admin_app(app), host, admin_port, lifespan="off", limits=limits)

    async def both() -> None:
        await asyncio.gather(main.serve(), admin.serve())

    import uvloop

    uvloop.run(both())
    return 0


# -- running a gateway in a thread (tests, benchmarks, demos) ---------------------------


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


class ServerThread:
    """uvicorn serving `app` on a loopback port in a background thread."""

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int | None = None,
        loop: str = "asyncio",
        admin_port: int | None = None,
        start_timeout_s: float = 60.0,
        limits: HttpLimits | None = None,
    ) -> None:
        self.host = host
        # How long `start()` (and `with`) waits for the app's startup: engines launched
        # in its lifespan can take minutes.
        self.start_timeout_s = start_timeout_s
        # Bound now and handed to uvicorn, which would otherwise bind only after the
        # lifespan (engines starting for a minute): a port merely found free here could
        # be taken by then on a busy machine.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port or 0))
        self.port = int(self._sock.getsockname()[1])
        config = uvicorn.Config(
            app,
            host=self.host,
            port=self.port,
            loop=loop,
            http=(limits or HttpLimits()).protocol(getattr(app.state, "http_codes", None)),
            access_log=False,
            log_level="warning",
            lifespan="on",
        )
        self.server = uvicorn.Server(config)
        # `/health` and `/metrics` apart (GatewayConfig.admin_port), on the same loop.
        self.admin: uvicorn.Server | None = None
        self.admin_port = admin_port
        if admin_port is not None:
            self.admin = uvicorn.Server(
                uvicorn.Config(
                    create_admin_app(app),
                    host=self.host,
                    port=admin_port,
                    loop=loop,
                    access_log=False,
                    log_level="warning",
                    lifespan="off",
                )
            )
        self._thread = threading.Thread(target=self._run, name="wasma-gateway", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        async def serve() -> None:
            if self.admin is None:
                await self.server.serve(sockets=[self._sock])
            else:
                await asyncio.gather(self.server.serve(sockets=[self._sock]), self.admin.serve())

        try:
            asyncio.run(serve())
        except BaseException as exc:  # surfaced by start()
            self._error = exc

    def start(self, timeout_s: float | None = None) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + (self.start_timeout_s if timeout_s is None else timeout_s)
        while not self.server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"gateway failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError("gateway did not start in time")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.admin is not None:
            self.admin.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
