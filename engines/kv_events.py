"""vLLM's KV events, as wasma's: the wire format vLLM's ZMQ publisher sends, their
re-keying by wasma's chain hash, and one engine's feed of them.

Every reader of a vLLM engine's events goes through here: the in-process engine
(`vllm_engine`), a remote `vllm serve` (`openai_engine`) and the Ray Serve front end's
scheduling state, which subscribes to each replica's publisher.

- wire: msgpack `KVEventBatch`es of tagged `BlockStored` / `BlockRemoved` /
  `AllBlocksCleared`, mirrored from `vllm/distributed/kv_events.py` so a router can decode
  them without importing vLLM. Unknown fields are ignored, so newer servers that add
  fields still decode.
- re-keying: a stored block's wasma hash is `hash_token_blocks` over the event's token
  ids, chained from its parent's wasma hash, so the cluster prefix index matches what the
  router computes for the same tokens without knowing vLLM's hash seed or algorithm
  (Dynamo's approach).
- frames: vLLM sends (topic, sequence number, payload); a numbering that goes back means
  the publisher restarted with an empty cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from wasma.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from wasma.core.tokens import ROOT_HASH, hash_token_blocks

log = logging.getLogger(__name__)


class _WireEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class WireBlockStored(_WireEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class WireBlockRemoved(_WireEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None = None


class WireAllBlocksCleared(_WireEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[WireBlockStored | WireBlockRemoved | WireAllBlocksCleared]
    data_parallel_rank: int | None = None


_BATCH_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def event_kind(event: Any) -> str:
    """`BlockStored`, `BlockRemoved` or `AllBlocksCleared`: a vLLM event's msgspec tag."""
    config = getattr(type(event), "__struct_config__", None)
    tag = getattr(config, "tag", None)
    return tag if isinstance(tag, str) else type(event).__name__


class KVEventTranslator:
    """Re-keys vLLM KV events by wasma chain hashes.

    vLLM's block hashes depend on its hash algorithm and seed; wasma's router hashes token
    ids with `hash_token_blocks`. A stored block's wasma hash is the chain over its token
    ids from its parent's wasma hash, so we keep engine-hash -> wasma-hash for blocks
    the engine holds. vLLM may cache the same content in two blocks (computed twice
    concurrently) and then evicts each copy separately, so entries are reference counted
    and wasma hears of a removal only when the last copy goes."""

    def __init__(self, engine: str, block_size: int) -> None:
        self.engine = engine
        self.block_size = block_size
        self._map: dict[Any, list[int]] = {}  # engine hash -> [wasma hash, copies]
        # The same for each offloading tier (KV events of medium "CPU", ...): vLLM's
        # offloading connector names a block by its GPU block hash.
        self._tiers: dict[str, dict[Any, list[int]]] = {}
        self.untranslated = 0  # stored blocks whose parent we never saw

    def __len__(self) -> int:
        return len(self._map)

    def translate(self, event: Any) -> list[KVEvent]:
        """wasma's events for one vLLM event: vLLM's own class or its wire mirror here
        (both tagged msgspec structs, named by their tag)."""
        name = event_kind(event)
        medium = getattr(event, "medium", None)
        if medium is not None and medium.upper() != "GPU" and name != "AllBlocksCleared":
            return self._translate_tier(name, event, medium.upper())
        if name == "BlockStored":
            return self._stored(event)
        if name == "BlockRemoved":
            gone: list[int] = []
            for h in event.block_hashes:
                entry = self._map.get(h)
                if entry is None:
                    continue
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._map[h]
                    gone.append(entry[0])
            return [BlockRemoved(self.engine, tuple(gone))] if gone else []
        if name == "AllBlocksCleared":
            return self.clear()
        return []

    def clear(self) -> list[KVEvent]:
        self._map.clear()
        self._tiers.clear()
        return [AllBlocksCleared(self.engine)]

    def _translate_tier(self, name: str, event: Any, medium: str) -> list[KVEvent]:
        """An offloading tier's event, re-keyed as GPU events are and kept apart."""
        tier = self._tiers.setdefault(medium, {})
        if name == "BlockRemoved":
            gone: list[int] = []
            for h in event.block_hashes:
                entry = tier.get(h)
                if entry is None:
                    continue
                entry[1] -= 1
                if entry[1] <= 0:
                    del tier[h]
                    gone.append(entry[0])
            return [BlockRemoved(self.engine, tuple(gone), medium)] if gone else []
        if name != "BlockStored":
            return []

        def known(h: Any) -> int | None:
            entry = tier.get(h) or self._map.get(h)
            return None if entry is None else entry[0]

        bs = event.block_size or self.block_size
        tokens = list(event.token_ids)
        parent_engine = event.parent_block_hash
        wasma: list[int | None]
        parent: int | None = None
        if tokens:
            if parent_engine is None:
                root: int | None = ROOT_HASH
            else:
                root = parent = known(parent_engine)
            if root is None:
                self.untranslated += len(event.block_hashes)
                return []
            wasma = list(hash_token_blocks(tokens, bs, root)[: len(event.block_hashes)])
        else:
            # A placeholder without content: only a block the engine reported on GPU
            # (or this tier) before can be named.
            wasma = [known(h) for h in event.block_hashes]
        stored: list[int] = []
        for h, w in zip(event.block_hashes, wasma, strict=False):
            if w is None:
                self.untranslated += 1
                continue
            entry = tier.get(h)
            if entry is None:
                tier[h] = [w, 1]
            else:
                entry[1] += 1
            stored.append(w)
        return [BlockStored(self.engine, tuple(stored), parent, medium)] if stored else []

    def _stored(self, event: Any) -> list[KVEvent]:
        bs = event.block_size or self.block_size
        parent_engine = event.parent_block_hash
        if parent_engine is None:
            parent = ROOT_HASH
        else:
            entry = self._map.get(parent_engine)
            if entry is None:
                # Events from before we subscribed (or dropped by ZMQ's high-water mark):
                # without the parent's tokens the chain cannot be rebuilt.
                self.untranslated += len(event.block_hashes)
                return []
            parent = entry[0]
        tokens = list(event.token_ids)
        wasma = hash_token_blocks(tokens, bs, parent)
        if len(wasma) != len(event.block_hashes):
            log.warning(
                "engine %s: BlockStored with %d hashes but %d tokens of block size %d",
                self.engine,
                len(event.block_hashes),
                len(tokens),
                bs,
            )
            wasma = wasma[: len(event.block_hashes)]
        new: list[int] = []
        for h, w in zip(event.block_hashes, wasma, strict=False):
            entry = self._map.get(h)
            if entry is None:
                self._map[h] = [w, 1]
                new.append(w)
            else:
                entry[1] += 1
        if not new:
            return []
        # Report the whole run even if a middle block was a duplicate: the index keys
        # blocks by hash, so re-adding a known one is harmless and keeps the chain whole.
        return [
            BlockStored(
                self.engine,
                tuple(wasma),
                None if parent_engine is None else parent,
            )
        ]


class KVEventFeed:
    """One engine's published batches, as wasma's events: decoded, checked for a
    restarted publisher, re-keyed."""

    def __init__(self, engine: str, block_size: int) -> None:
        self.engine = engine
        self.translator = KVEventTranslator(engine, block_size)
        self.events_received = 0  # vLLM events decoded (stored, removed, cleared)
        self._seq: int | None = None  # the last batch's sequence number

    def payload(self, payload: bytes, seq: int | None = None) -> list[KVEvent]:
        """One batch's events; `seq` is its sequence number where the publisher sends
        one. Raises `msgspec.DecodeError` / `ValidationError` for a batch it cannot read."""
        batch = _BATCH_DECODER.decode(payload)
        out: list[KVEvent] = []
        if seq is not None:
            if self._seq is not None and seq <= self._seq:
                # Numbering went back: the server restarted (ZMQ reconnected by itself)
                # with an empty cache, and never sent removals for the blocks it had.
                # Without this its blocks would look cached twice, and the same blocks
                # stored again would be taken for second copies and never announced.
                log.info("engine %s: KV events restarted at %d; cache cleared", self.engine, seq)
                out += self.translator.clear()
            self._seq = seq
        for event in batch.events:
            self.events_received += 1
            out += self.translator.translate(event)
        return out

    def frames(self, frames: Sequence[bytes]) -> list[KVEvent]:
        """One ZMQ message: (topic, sequence number, payload), or (topic, payload) from
        older publishers. An unreadable batch is logged and skipped."""
        seq = int.from_bytes(frames[1], "big") if len(frames) >= 3 else None
        try:
            return self.payload(frames[-1], seq)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("engine %s: undecodable KV event batch: %s", self.engine, exc)
            return []


def bind_subscriber(sock: zmq.Socket[Any], host: str = "127.0.0.1") -> str:
    """Make `sock` (a SUB socket) take every topic and never drop a message (a gap breaks
    hash chains), bind it on a free port of `host`, and return the endpoint a vLLM
    publisher connects to (a non-wildcard tcp endpoint makes vLLM connect, not bind):
    no race between picking a port and binding it."""
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(f"tcp://{host}:0")
    port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    return f"tcp://{host}:{port}"


__all__ = [
    "KVEventBatch",
    "KVEventFeed",
    "KVEventTranslator",
    "WireAllBlocksCleared",
    "WireBlockRemoved",
    "WireBlockStored",
    "bind_subscriber",
]
