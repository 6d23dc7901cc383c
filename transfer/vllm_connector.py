"""A vLLM KV connector that loads a request's prefix KV from a peer engine.

Load it with
    kv_transfer_config={"kv_connector": "WasmaPeerConnector",
                        "kv_connector_module_path": "wasma.transfer.vllm_connector",
                        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"wasma_listen": "127.0.0.1:7001"}}
("127.0.0.1:0" binds a free port; with "wasma_address_file": PATH the worker writes the
address it bound to PATH),
and name the peer per request in `kv_transfer_params` (vLLM reads them from
`SamplingParams.extra_args["kv_transfer_params"]`): {"wasma_peer": "host:port"}, with
optionally "wasma_mode": "prefetch" (load while the request waits, vLLM's asynchronous
load) instead of the default "layerwise" (load during its forward pass).

Every engine publishes the full blocks of each prompt it prefills to its own peer server
(`wasma.transfer.kv_peer`). An engine given a peer asks it how many leading blocks of the prompt
it holds, allocates them, and during the forward pass streams them in layer by layer:
`wait_for_layer_load` waits only for the layer about to run, so layer i computes while
layer i+1 is still arriving. A dead peer or a bad checksum marks the blocks invalid (or
the prefetch failed), and vLLM recomputes them (kv_load_failure_policy "recompute").

Limits: one KV cache group (plain decoder attention); a prompt is published only when its
whole prefill is scheduled in one step (no chunked prefill of the producer's prompt).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from wasma.transfer.kv_peer import (
    LayerBlocks,
    PeerBackoff,
    PeerError,
    PeerServer,
    PeerStore,
    block_keys,
    fetch,
    try_query,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

PEER_PARAM = "wasma_peer"
# "layerwise": load during the forward pass, layer by layer (the request runs at once);
# "prefetch": load while the request waits (vLLM's asynchronous load), then run it.
MODE_PARAM = "wasma_mode"
MODES = ("layerwise", "prefetch")
LAYER_TIMEOUT_S = 30.0
_PUBLISHED_MEMORY = 4096  # prompts the scheduler remembers having published


@dataclass(frozen=True)
class LoadSpec:
    req_id: str
    peer: str
    key: str  # chained key of the last block to load
    first_block: int  # blocks before this one are already computed locally
    block_ids: tuple[int, ...]  # where blocks first_block.. go in the paged cache


@dataclass(frozen=True)
class StoreSpec:
    req_id: str
    keys: tuple[str, ...]  # one per full block of the prompt
    block_ids: tuple[int, ...]


class WasmaLoadStats(KVConnectorStats):
    """The loads from peers that ended since vLLM last asked: `data["loads"]` holds one
    `[bytes, seconds, ok]` per load (`ok` false: it failed and vLLM recomputes). vLLM
    ships this dict from the worker to its stat loggers, where wasma's engine reads it
    (`engines/vllm_engine.py`)."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data={"loads": list((data or {}).get("loads", []))})

    def reset(self) -> None:
        self.data = {"loads": []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data["loads"].extend(other.data.get("loads", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        loads = self.data["loads"]
        done = [load for load in loads if load[2]]
        return {
            "loads": len(done),
            "failed_loads": len(loads) - len(done),
            "loaded_bytes": sum(int(load[0]) for load in done),
            "load_seconds": sum(float(load[1]) for load in done),
        }

    def is_empty(self) -> bool:
        return not self.data["loads"]


@dataclass
class WasmaConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)  # during this step's forward
    prefetches: list[LoadSpec] = field(default_factory=list)  # in the background
    stores: list[StoreSpec] = field(default_factory=list)


class _Load:
    """One in-flight fetch: a thread fills `layers` in order; the forward pass waits."""

    def __init__(
        self, spec: LoadSpec, on_layer: Callable[[LayerBlocks], None] | None = None
    ) -> None:
        self.spec = spec
        self.on_layer = on_layer  # prefetch: inject each layer as it lands
        self.layers: dict[str, LayerBlocks] = {}
        self.error: str | None = None
        self.done = False
        self.nbytes = 0  # received so far
        self.seconds = 0.0  # from the fetch's start to its last layer (or failure)
        self.changed = threading.Condition()
        self.thread = threading.Thread(
            target=self._run, name=f"wasma-load-{spec.req_id}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            for layer in fetch(self.spec.peer, self.spec.key, self.spec.first_block):
                self.nbytes += len(layer.data)
                if self.on_layer is not None:
                    self.on_layer(layer)
                    continue
                with self.changed:
                    self.layers[layer.name] = layer
                    self.changed.notify_all()
        except (PeerError, ValueError, RuntimeError, KeyError) as exc:
            self.error = str(exc)
        finally:
            self.seconds = time.perf_counter() - start
            with self.changed:
                self.done = True
                self.changed.notify_all()

    def wait_layer(self, name: str, timeout_s: float) -> LayerBlocks | None:
        with self.changed:
            self.changed.wait_for(lambda: name in self.layers or self.done, timeout_s)
            return self.layers.get(name)


def _write_atomically(path: str, text: str) -> None:
    """Write `text` to `path` so a reader sees either nothing or all of it."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


class WasmaPeerConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        # scheduler side
        self._mode = str(extra.get("wasma_mode", "layerwise"))
        if self._mode not in MODES:
            raise ValueError(f"wasma_mode must be one of {', '.join(MODES)}")
        # req -> (peer, key, blocks, mode)
        self._pending: dict[str, tuple[str, str, int, str]] = {}
        self._loads: dict[str, tuple[str, str, int, int]] = {}
        self._prefetch_specs: list[LoadSpec] = []
        # Requests whose load failed: vLLM retries them from scratch, and they must not go
        # back to the same peer (it would fail again, forever).
        self._failed_reqs: set[str] = set()
        self._unreachable = PeerBackoff()
        self._published: OrderedDict[str, None] = OrderedDict()
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._block_dim: dict[str, int] = {}
        self._active: list[_Load] = []
        self._prefetching: dict[str, _Load] = {}
        self._failed_blocks: set[int] = set()
        self._saving: dict[str, list[LayerBlocks]] = {}
        self._ended: list[list[Any]] = []  # [bytes, seconds, ok] per load, for the stats
        self._store: PeerStore | None = None
        self._server: PeerServer | None = None
        if role == KVConnectorRole.WORKER:
            self._store = PeerStore(int(extra.get("wasma_store_bytes", 256 << 20)))
            listen = str(extra.get("wasma_listen", "127.0.0.1:0"))
            host, _, port = listen.rpartition(":")
            self._server = PeerServer(
                self._store,
                host or "127.0.0.1",
                int(port or 0),
                allow_fault_injection=bool(extra.get("wasma_allow_fault_injection", False)),
            )
            logger.info("wasma KV peer server on %s", self._server.address)
            address_file = extra.get("wasma_address_file")
            if address_file:
                # The engine that started this worker learns the port bound here (port 0
                # in wasma_listen) from this file: picking a free port beforehand and
                # binding it later races every other process binding ports meanwhile.
                _write_atomically(str(address_file), self._server.address)

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        peer = params.get(PEER_PARAM)
        tokens = list(request.prompt_token_ids or [])
        if not peer or not tokens or request.request_id in self._failed_reqs:
            return 0, False
        # Leave at least one prompt token to compute: the model must produce logits.
        usable = (len(tokens) - 1) // self._block_size
        keys = block_keys(tokens[: usable * self._block_size], self._block_size)
        now = time.monotonic()
        if self._unreachable.skip(str(peer), now):
            return 0, False
        held = try_query(str(peer), keys)
        if held is None:
            logger.warning("wasma KV peer %s cannot be asked; computing instead", peer)
            self._unreachable.failed(str(peer), now)
            return 0, False
        if held * self._block_size <= num_computed_tokens:
            return 0, False
        mode = str(params.get(MODE_PARAM, self._mode))
        mode = mode if mode in MODES else self._mode
        self._pending[request.request_id] = (str(peer), keys[held - 1], held, mode)
        return held * self._block_size - num_computed_tokens, mode == "prefetch"

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        pending = self._pending.pop(request.request_id, None)
        if num_external_tokens <= 0 or pending is None:
            return
        peer, key, held, mode = pending
        first = (held * self._block_size - num_external_tokens) // self._block_size
        if mode == "prefetch":
            # The request waits (WAITING_FOR_REMOTE_KVS) while its blocks fill; `blocks`
            # lists all its blocks from the first.
            (block_ids, *_) = blocks.get_block_ids()
            self._prefetch_specs.append(
                LoadSpec(request.request_id, peer, key, first, tuple(block_ids[first:held]))
            )
        else:
            self._loads[request.request_id] = (peer, key, first, held)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = WasmaConnectorMetadata(prefetches=self._prefetch_specs)
        self._prefetch_specs = []
        for new in scheduler_output.scheduled_new_reqs:
            block_ids = list(new.block_ids[0]) if new.block_ids else []
            load = self._loads.pop(new.req_id, None)
            if load is not None:
                peer, key, first, held = load
                meta.loads.append(
                    LoadSpec(new.req_id, peer, key, first, tuple(block_ids[first:held]))
                )
            tokens = list(new.prompt_token_ids or [])
            scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            if not tokens or new.num_computed_tokens + scheduled < len(tokens):
                continue  # chunked prefill: not published (see module docstring)
            keys = block_keys(tokens, self._block_size)
            if not keys or keys[-1] in self._published:
                continue
            meta.stores.append(StoreSpec(new.req_id, tuple(keys), tuple(block_ids[: len(keys)])))
            self._published[keys[-1]] = None
            while len(self._published) > _PUBLISHED_MEMORY:
                self._published.popitem(last=False)
        # Requests that were allocated but not scheduled this step keep their load.
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._failed_reqs.update(connector_output.failed_recving or ())

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        self._failed_reqs.discard(request.request_id)
        return False, None

    # ------------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        for name, cache in self._kv_caches.items():
            # The block axis is the one as long as the block count (dim 0 on CPU,
            # dim 1 for the (2, blocks, ...) GPU layouts).
            dims = [d for d, size in enumerate(cache.shape) if size == num_blocks]
            self._block_dim[name] = dims[0] if dims else 0

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, WasmaConnectorMetadata)
        self._active = [_Load(spec) for spec in meta.loads if spec.block_ids]
        for spec in meta.prefetches:
            self._prefetching[spec.req_id] = _Load(spec, self._injector(spec))

    def _injector(self, spec: LoadSpec) -> Callable[[LayerBlocks], None]:
        def inject(layer: LayerBlocks) -> None:
            cache = self._kv_caches.get(layer.name)
            if cache is None:
                raise KeyError(f"no local layer {layer.name!r}")
            # The blocks belong to a request that is not running: writing them while
            # other requests compute touches nothing those read.
            self._inject(cache, self._block_dim[layer.name], layer, spec.block_ids)

        return inject

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Prefetches that finished: failed ones are reported too, and vLLM (policy
        "recompute") then computes the request from scratch."""
        results = KVConnectorTransferResults()
        for req_id, load in list(self._prefetching.items()):
            if not load.done:
                continue
            del self._prefetching[req_id]
            results.finished_recving.add(req_id)
            self._ended.append([load.nbytes, load.seconds, load.error is None])
            if load.error is not None:
                logger.warning(
                    "wasma: prefetching %s from %s failed (%s); recomputing",
                    req_id,
                    load.spec.peer,
                    load.error,
                )
                results.failed_recving.add(req_id)
        return results

    def wait_for_layer_load(self, layer_name: str) -> None:
        cache = self._kv_caches.get(layer_name)
        if cache is None:
            return
        for load in self._active:
            if load.error is not None and load.spec.block_ids[0] in self._failed_blocks:
                continue
            layer = load.wait_layer(layer_name, LAYER_TIMEOUT_S)
            if layer is None:
                self._fail(load, load.error or f"layer {layer_name} never arrived")
                continue
            try:
                self._inject(cache, self._block_dim[layer_name], layer, load.spec.block_ids)
            except (ValueError, RuntimeError) as exc:
                self._fail(load, f"layer {layer_name} does not fit: {exc}")

    def _fail(self, load: _Load, reason: str) -> None:
        if load.error is None:
            load.error = reason
        if not set(load.spec.block_ids) <= self._failed_blocks:
            logger.warning(
                "wasma: loading %s from %s failed (%s); recomputing",
                load.spec.req_id,
                load.spec.peer,
                reason,
            )
        self._failed_blocks.update(load.spec.block_ids)

    @staticmethod
    def _inject(
        cache: torch.Tensor, block_dim: int, layer: LayerBlocks, block_ids: tuple[int, ...]
    ) -> None:
        dtype = getattr(torch, layer.dtype)
        raw = torch.frombuffer(bytearray(layer.data), dtype=torch.uint8)
        blocks = raw.view(dtype).reshape(layer.shape)
        if blocks.shape[0] != len(block_ids):
            raise ValueError(f"{blocks.shape[0]} blocks for {len(block_ids)} slots")
        index = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        cache.index_copy_(block_dim, index, blocks.movedim(0, block_dim).to(cache.device))

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, WasmaConnectorMetadata)
        if not meta.stores:
            return
        block_dim = self._block_dim.get(layer_name, 0)
        for spec in meta.stores:
            index = torch.tensor(spec.block_ids, dtype=torch.long, device=kv_layer.device)
            blocks = kv_layer.index_select(block_dim, index).movedim(block_dim, 0)
            host = blocks.detach().to("cpu").contiguous()
            self._saving.setdefault(spec.req_id, []).append(
                LayerBlocks(
                    layer_name,
                    str(host.dtype).removeprefix("torch."),
                    tuple(host.shape),
                    host.view(torch.uint8).numpy().tobytes(),
                )
            )

    def wait_for_save(self) -> None:
        if self._store is None:
            return
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, WasmaConnectorMetadata)
            for spec in meta.stores:
                layers = self._saving.pop(spec.req_id, [])
                if layers:
                    self._store.put(spec.keys, layers)
        self._saving.clear()
        for load in self._active:
            load.thread.join(timeout=LAYER_TIMEOUT_S)
            # A layer that did not fit fails the load even where every byte arrived.
            ok = (
                load.done
                and load.error is None
                and not set(load.spec.block_ids) & self._failed_blocks
            )
            self._ended.append([load.nbytes, load.seconds, ok])
        self._active = []

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if not self._ended:
            return None
        stats, self._ended = WasmaLoadStats({"loads": self._ended}), []
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return WasmaLoadStats(data)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()

    @property
    def peer_address(self) -> str | None:
        return self._server.address if self._server else None
