"""The retention tier of wasma's vLLM scheduler, on vLLM's own block pool (no engine).

The end-to-end check, a real engine keeping a retained prefix through churn that evicts
an unretained one, is in test_vllm_engine.py."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    make_block_hash_with_group_id,
)

from wasma.engines.base import MAX_RETAIN_S, RELEASE_ARG, RETAIN_ARG, RETAIN_USE_ARG
from wasma.engines.vllm_retention import (
    RetentionLeases,
    TieredFreeQueue,
    release_keys,
    retain_seconds,
    retain_use_seconds,
)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _pool(n: int = 12) -> tuple[BlockPool, TieredFreeQueue, RetentionLeases, _Clock]:
    pool = BlockPool(num_gpu_blocks=n, enable_caching=True, hash_block_size=16)
    clock = _Clock()
    leases = RetentionLeases(clock)
    queue = TieredFreeQueue(pool.free_block_queue, leases.use_of, leases.forget)
    pool.free_block_queue = queue  # type: ignore[assignment]
    return pool, queue, leases, clock


def _cached(pool: BlockPool, n: int, tag: bytes) -> list[KVCacheBlock]:
    """Allocate `n` blocks and give them content (a hash), as a finished prefill does."""
    blocks = pool.get_new_blocks(n)
    for i, b in enumerate(blocks):
        b.set_block_hash(make_block_hash_with_group_id(BlockHash(tag + bytes([i])), 0), 16)
    return blocks


def _ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_retained_blocks_are_handed_out_after_every_ordinary_free_block() -> None:
    pool, queue, leases, _ = _pool(12)  # 11 usable: block 0 is vLLM's null block
    kept = _cached(pool, 3, b"k")
    plain = _cached(pool, 3, b"p")
    leases.grant(_ids(kept), 60.0)
    # vLLM frees a request's blocks tail first; the retained request goes first, so an
    # LRU queue alone would evict it first.
    pool.free_blocks(reversed(kept))
    pool.free_blocks(reversed(plain))
    assert pool.get_num_free_blocks() == 11
    assert queue.num_kept == 3
    taken = pool.get_new_blocks(8)  # 5 never-used blocks, then the unretained request
    assert set(_ids(plain)) <= set(_ids(taken))
    assert not set(_ids(kept)) & set(_ids(taken))
    assert all(b.block_hash is not None for b in kept)  # still cached: a hit would find it
    # Only when nothing ordinary is free does the retention tier give way, tail first.
    more = pool.get_new_blocks(2)
    assert _ids(more) == _ids(kept[::-1][:2])
    assert kept[2].block_hash is None and kept[0].block_hash is not None
    assert not leases.holds(kept[2])  # reused: its lease went with its content


def test_a_prefix_hit_takes_a_retained_block_back_and_its_free_returns_it() -> None:
    pool, queue, leases, _ = _pool(8)
    kept = _cached(pool, 2, b"k")
    leases.grant(_ids(kept), 60.0)
    pool.free_blocks(reversed(kept))
    pool.touch(kept)  # a child's prefix hit
    assert queue.num_kept == 0 and not queue.kept_at
    assert pool.get_num_free_blocks() == 7 - 2
    pool.free_blocks(reversed(kept))  # the child finishes while the lease runs
    assert queue.num_kept == 2


def test_a_lapsed_lease_returns_blocks_to_the_ordinary_queue_back() -> None:
    pool, queue, leases, clock = _pool(8)
    kept = _cached(pool, 2, b"k")
    leases.grant(_ids(kept), 5.0)
    pool.free_blocks(reversed(kept))
    other = _cached(pool, 2, b"o")
    pool.free_blocks(reversed(other))
    clock.t += 4.0
    assert leases.lapsed() == []
    clock.t += 2.0
    lapsed = leases.lapsed()
    assert sorted(lapsed) == sorted(_ids(kept))
    for bid in lapsed:
        queue.requeue(pool.blocks[bid])
    assert queue.num_kept == 0
    # Now ordinary, and the most recently released: evicted after `other`.
    order = _ids(queue.get_all_free_blocks())
    assert order.index(other[0].block_id) < order.index(kept[0].block_id)
    # Freed again after the lease: ordinary.
    pool.touch(kept)
    pool.free_blocks(reversed(kept))
    assert queue.num_kept == 0


def test_a_renewed_lease_outlives_the_first() -> None:
    _, _, leases, clock = _pool(4)
    leases.grant([1, 2], 5.0)
    leases.grant([2], 50.0)
    clock.t += 10.0
    assert leases.lapsed() == [1]
    assert leases.holds(KVCacheBlock(2)) and not leases.holds(KVCacheBlock(1))


def test_content_less_blocks_are_never_retained() -> None:
    pool, queue, leases, _ = _pool(6)
    blocks = pool.get_new_blocks(2)  # no hash: a partial block, say
    leases.grant(_ids(blocks), 60.0)
    pool.free_blocks(blocks)
    assert queue.num_kept == 0  # vLLM prepends them for reuse first
    assert _ids(pool.get_new_blocks(2)) == _ids(blocks)


def test_the_tiers_iterate_in_eviction_order() -> None:
    pool, queue, leases, _ = _pool(6)
    kept = _cached(pool, 2, b"k")
    plain = _cached(pool, 2, b"p")
    leases.grant(_ids(kept), 60.0)
    pool.free_blocks(kept)
    pool.free_blocks(plain)
    order = _ids(list(queue.iter_blocks_after(None)))
    assert order[-2:] == _ids(kept)
    assert _ids(list(queue.iter_blocks_after(kept[0]))) == [kept[1].block_id]
    assert _ids(list(queue.iter_blocks_after(plain[1]))) == _ids(kept)


def test_retained_blocks_wanted_latest_are_handed_out_first() -> None:
    """Steps-to-use: among retained free blocks, those wanted latest go first (unsaid,
    first of all), equal times in the order freed; a block wanted sooner by a second
    claim moves behind the rest, and back when that claim ends."""
    pool, queue, leases, clock = _pool(10)
    soon, late, unsaid = (_cached(pool, 2, tag) for tag in (b"s", b"l", b"u"))
    leases.grant(_ids(soon), 60.0, use_at=clock.t + 1.0)
    leases.grant(_ids(late), 60.0, use_at=clock.t + 9.0)
    leases.grant(_ids(unsaid), 60.0)
    for blocks in (soon, late, unsaid):
        pool.free_blocks(reversed(blocks))
    order = _ids(queue.get_all_free_blocks())[-6:]
    assert order == _ids(unsaid[::-1] + late[::-1] + soon[::-1])
    for bid in leases.hold("child", _ids(late), use_at=clock.t + 0.5):
        queue.requeue(pool.blocks[bid])
    assert _ids(queue.get_all_free_blocks())[-2:] == _ids(late)
    for bid in leases.release_hold("child"):
        queue.requeue(pool.blocks[bid])
    assert _ids(queue.get_all_free_blocks())[-6:] == order[:2] + _ids(late) + order[4:]
    pool.get_new_blocks(3)  # the never-used ordinary blocks first, then the tier
    taken = pool.get_new_blocks(5)
    assert _ids(taken) == order[:2] + _ids(late) + [order[4]]


def test_a_lease_ended_by_its_key_returns_its_blocks_to_the_ordinary_queue() -> None:
    pool, queue, leases, _ = _pool(8)
    kept = _cached(pool, 2, b"k")
    leases.grant(_ids(kept), 600.0, key="parent")
    pool.free_blocks(reversed(kept))
    assert queue.num_kept == 2
    assert leases.end("stranger") == []
    for bid in leases.end("parent"):
        queue.requeue(pool.blocks[bid])
    assert queue.num_kept == 0 and not any(leases.holds(b) for b in kept)
    assert _ids(queue.get_all_free_blocks())[-2:] == _ids(kept)
    assert leases.end("parent") == []  # once
    assert leases.lapsed() == []


@pytest.mark.parametrize(
    ("extra", "use", "keys"),
    [
        (None, float("inf"), []),
        ({RETAIN_USE_ARG: 2.5, RELEASE_ARG: ["a", "b"]}, 2.5, ["a", "b"]),
        ({RETAIN_USE_ARG: 0, RELEASE_ARG: "a"}, 0.0, ["a"]),
        ({RETAIN_USE_ARG: -1, RELEASE_ARG: [1, "b", None]}, float("inf"), ["b"]),
        ({RETAIN_USE_ARG: float("nan"), RELEASE_ARG: 7}, float("inf"), []),
        ({RETAIN_USE_ARG: True}, float("inf"), []),
        ({RETAIN_USE_ARG: 1e9}, MAX_RETAIN_S, []),
    ],
)
def test_use_times_and_release_keys_a_request_carries(
    extra: dict[str, object] | None, use: float, keys: list[str]
) -> None:
    assert retain_use_seconds(extra) == use
    assert release_keys(extra) == keys


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        (None, 0.0),
        ({}, 0.0),
        ({RETAIN_ARG: 30}, 30.0),
        ({RETAIN_ARG: 2.5}, 2.5),
        ({RETAIN_ARG: -1}, 0.0),
        ({RETAIN_ARG: float("nan")}, 0.0),
        ({RETAIN_ARG: "30"}, 0.0),
        ({RETAIN_ARG: True}, 0.0),
        ({RETAIN_ARG: 1e9}, MAX_RETAIN_S),
    ],
)
def test_the_lease_a_request_asks_for(extra: dict[str, object] | None, want: float) -> None:
    assert retain_seconds(extra) == want


def test_the_engines_name_the_scheduler_that_exists() -> None:
    from wasma.engines.vllm_engine import RETAINING_SCHEDULER
    from wasma.engines.vllm_retention import SCHEDULER_CLS

    assert RETAINING_SCHEDULER == SCHEDULER_CLS


def test_a_hold_moves_a_free_block_behind_the_ordinary_queue_until_released() -> None:
    pool, queue, leases, _ = _pool(8)
    prefix = _cached(pool, 2, b"h")
    pool.free_blocks(reversed(prefix))  # a parent's context, freed without a lease
    assert queue.num_kept == 0
    for bid in leases.hold("child", _ids(prefix)):  # its child arrives, will hit it
        queue.requeue(pool.blocks[bid])
    assert queue.num_kept == 2
    assert not set(_ids(prefix)) & set(_ids(pool.get_new_blocks(5)))  # churn passes by
    assert sorted(leases.release_hold("child")) == sorted(_ids(prefix))
    assert leases.release_hold("child") == []  # once


def test_a_hold_outlasts_a_lease_on_the_same_block() -> None:
    _, _, leases, clock = _pool(6)
    leases.grant([1], 5.0)
    leases.hold("r", [1, 2])
    clock.t += 10.0
    assert leases.lapsed() == []  # still held: nothing to release
    block = KVCacheBlock(1)
    assert leases.holds(block)
    assert leases.release_hold("r") == [1, 2]
    assert not leases.holds(block)


def test_a_reused_block_is_no_longer_held_by_the_request_that_held_its_old_content() -> None:
    _, _, leases, _ = _pool(6)
    leases.hold("old", [3])
    leases.forget([KVCacheBlock(3)])  # handed out for new content
    leases.hold("new", [3])
    assert leases.release_hold("old") == []  # does not end the new hold
    assert leases.holds(KVCacheBlock(3))
    assert leases.release_hold("new") == [3]
