from __future__ import annotations

import pytest

from wasma.transfer.kv_peer import (
    LayerBlocks,
    PeerBackoff,
    PeerError,
    PeerServer,
    PeerStore,
    block_keys,
    fetch,
    query,
    set_fault,
    try_query,
)


def _layers(blocks: int, names: tuple[str, ...] = ("l0", "l1", "l2")) -> list[LayerBlocks]:
    row = 64
    return [
        LayerBlocks(
            name, "float32", (blocks, 4, 4), bytes((i * 7 + j) % 256 for j in range(blocks * row))
        )
        for i, name in enumerate(names)
    ]


def test_block_keys_chain_over_full_blocks() -> None:
    a = block_keys(list(range(100)), 32)
    b = block_keys([*range(96), 999, 998], 32)
    assert len(a) == 3 and a == b  # only full blocks; the tail does not matter
    c = block_keys([5, *range(1, 96)], 32)
    assert all(x != y for x, y in zip(a, c, strict=True))  # a change poisons what follows


def test_store_longest_prefix_slices_and_eviction() -> None:
    store = PeerStore(capacity_bytes=2000)  # two prompts of 768 bytes fit
    keys = block_keys(list(range(128)), 32)
    store.put(keys, _layers(4))
    other = block_keys([*range(64), *range(500, 564)], 32)
    assert store.longest_prefix(other) == 2  # shares the first two blocks
    assert store.longest_prefix(block_keys(list(range(1000, 1064)), 32)) == 0
    part = store.blocks(keys[2], first=1)  # blocks 1 and 2
    assert [p.shape for p in part] == [(2, 4, 4)] * 3
    assert part[0].data == _layers(4)[0].data[64:192]
    store.put(block_keys(list(range(2000, 2128)), 32), _layers(4))
    store.put(block_keys(list(range(3000, 3128)), 32), _layers(4))  # evicts the oldest
    assert store.longest_prefix(keys) == 0
    with pytest.raises(ValueError):
        store.put(keys, _layers(3))


def test_server_round_trip_and_faults() -> None:
    store = PeerStore()
    keys = block_keys(list(range(160)), 32)
    store.put(keys, _layers(5))
    server = PeerServer(store, allow_fault_injection=True)
    try:
        assert query(server.address, keys) == 5
        assert query(server.address, [*keys[:2], "0" * 32]) == 2
        got = list(fetch(server.address, keys[3], first=2))
        assert [g.name for g in got] == ["l0", "l1", "l2"]
        assert got[1].data == _layers(5)[1].data[128:256] and got[1].shape == (2, 4, 4)
        for fault, message in (("corrupt", "checksum"), ("truncate", "mid-transfer")):
            set_fault(server.address, fault)
            stream = fetch(server.address, keys[4], first=0)
            assert next(stream).name == "l0"  # earlier layers still arrive and verify
            with pytest.raises(PeerError, match=message):
                list(stream)
        set_fault(server.address, None)
        with pytest.raises(PeerError, match="no longer held"):
            list(fetch(server.address, "f" * 32, first=0))
    finally:
        server.close()
    assert query(server.address, keys) == 0  # a dead peer holds nothing
    assert try_query(server.address, keys) is None  # ...and cannot be asked
    with pytest.raises(PeerError, match="cannot reach"):
        list(fetch(server.address, keys[0], first=0))


def test_fault_injection_is_off_by_default() -> None:
    server = PeerServer(PeerStore())
    try:
        with pytest.raises(PeerError, match="unknown op"):
            set_fault(server.address, "corrupt")
    finally:
        server.close()


def test_an_unreachable_peer_is_skipped_for_a_while_then_asked_again() -> None:
    backoff = PeerBackoff(retry_s=10.0)
    assert not backoff.skip("a:1", 0.0)
    backoff.failed("a:1", 100.0)
    assert backoff.skip("a:1", 100.0) and backoff.skip("a:1", 109.9)
    assert not backoff.skip("b:1", 105.0)  # other peers are asked as usual
    assert not backoff.skip("a:1", 110.0)  # its time is up: asked again
    assert not backoff.skip("a:1", 110.1)
