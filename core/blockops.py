"""Per-block loops of the simulated KV cache and the prefix index, in one place.

A request's KV is a few hundred blocks, and every block passes through a string of
list and dict updates (reference counts, block -> hash, hash -> block, holder masks).
These functions are those loops. The Python ones here are the reference; the package
also builds them in C (`_blockops.c`, same results, same dict order, same exceptions),
which `block_ops()` returns when it is built. `WASMA_BLOCKOPS=python` picks the
reference (the tests run both).

The compiled functions take exact lists and dicts only: an OrderedDict keeps an order of
its own that C-level dict calls would bypass, so its owner uses the reference for it.
"""

from __future__ import annotations

import os
from bisect import insort
from collections import deque
from collections.abc import Sequence
from itertools import compress, repeat
from typing import Any, Protocol, cast


class BlockOps(Protocol):
    """What the reference module and the compiled one both provide."""

    def fill(self, lst: list[Any], indices: Sequence[int], value: Any) -> None: ...

    def scatter(self, lst: list[Any], indices: Sequence[int], values: Sequence[Any]) -> None: ...

    def add_at(self, lst: list[int], indices: Sequence[int], delta: int) -> None: ...

    def release(self, ref: list[int], blocks: Sequence[int]) -> list[int]: ...

    def del_keys(self, d: dict[Any, Any], keys: Sequence[Any]) -> None: ...

    def prefix_get(self, d: dict[Any, Any], keys: Sequence[Any], limit: int) -> list[Any]: ...

    def prefix_len(self, d: dict[Any, Any], keys: Sequence[Any]) -> int: ...

    def or_bits(self, d: dict[Any, int], keys: Sequence[Any], bit: int) -> int: ...

    def clear_bits(self, d: dict[Any, int], keys: Sequence[Any], bit: int) -> int: ...

    def match_runs(self, d: dict[Any, int], keys: Sequence[Any]) -> list[tuple[int, int]]: ...

    def evict(
        self, ref: list[int], hash_of: list[Any], cached: dict[Any, int], blocks: Sequence[int]
    ) -> list[Any]: ...

    def register(
        self,
        cached: dict[Any, int],
        hash_of: list[Any],
        blocks: Sequence[int],
        hashes: Sequence[Any],
        lo: int,
        hi: int,
    ) -> list[int] | None: ...

    def hash_run(
        self, parent: int, stream: int, start: int, count: int, step: int
    ) -> list[int]: ...

    def set_bits(self, out: list[Any], mask: int, value: Any) -> None: ...

    def retain_uses(
        self, retained: dict[Any, list[Any]], hashes: Sequence[Any], use_at: Any
    ) -> set[Any]: ...

    def release_uses(
        self, retained: dict[Any, list[Any]], hashes: Sequence[Any], use_at: Any
    ) -> tuple[list[Any], list[Any]]: ...

    def free_cached(
        self,
        cached: dict[Any, int],
        ref: list[int],
        run_of: list[Any],
        hashes: Sequence[Any],
        want: type,
        also_type: type,
        also: set[Any] | None,
    ) -> list[int]: ...


class PythonBlockOps:
    """The reference implementation."""

    @staticmethod
    def fill(lst: list[Any], indices: Sequence[int], value: Any) -> None:
        for i in indices:
            lst[i] = value

    @staticmethod
    def scatter(lst: list[Any], indices: Sequence[int], values: Sequence[Any]) -> None:
        if len(indices) != len(values):
            raise ValueError("indices and values differ in length")
        for i, v in zip(indices, values, strict=True):
            lst[i] = v

    @staticmethod
    def add_at(lst: list[int], indices: Sequence[int], delta: int) -> None:
        for i in indices:
            lst[i] += delta

    @staticmethod
    def release(ref: list[int], blocks: Sequence[int]) -> list[int]:
        """Drop one reference from each block, last first; those now at zero, in that
        order."""
        if list(map(ref.__getitem__, blocks)).count(1) == len(blocks):
            # Each block held once (the common case): all are free now.
            for b in blocks:
                ref[b] = 0
            return list(reversed(blocks))
        zero: list[int] = []
        for b in reversed(blocks):
            r = ref[b] - 1
            ref[b] = r
            if not r:
                zero.append(b)
        return zero

    @staticmethod
    def del_keys(d: dict[Any, Any], keys: Sequence[Any]) -> None:
        for k in keys:
            del d[k]

    @staticmethod
    def prefix_get(d: dict[Any, Any], keys: Sequence[Any], limit: int) -> list[Any]:
        """The values of the leading keys found in `d`, at most `limit`."""
        # map() looks up in C; chunks that double in size stop soon after the first
        # miss instead of looking up every key of a long chain whose hit is short.
        get = d.get
        n = min(limit, len(keys))
        out: list[Any] = []
        i, step = 0, 64
        while i < n:
            part = list(map(get, keys[i : min(i + step, n)]))
            if None in part:
                return out + part[: part.index(None)]
            out += part
            i += step
            step *= 2
        return out

    @staticmethod
    def prefix_len(d: dict[Any, Any], keys: Sequence[Any]) -> int:
        has = d.__contains__
        n = len(keys)
        i, step = 0, 64
        while i < n:
            part = list(map(has, keys[i : i + step]))
            if False in part:
                return i + part.index(False)
            i += step
            step *= 2
        return n

    @staticmethod
    def or_bits(d: dict[Any, int], keys: Sequence[Any], bit: int) -> int:
        """Every key's mask (0 if absent) gains `bit`; how many had it already. All
        masks are read before any is written (a key listed twice counts twice)."""
        masks = list(map(d.get, keys, repeat(0)))
        had = sum(1 for m in masks if m & bit) if any(masks) else 0
        d.update(zip(keys, map(bit.__or__, masks), strict=True))
        return had

    @staticmethod
    def clear_bits(d: dict[Any, int], keys: Sequence[Any], bit: int) -> int:
        """Each key holding `bit` loses it, in order; an entry left with no bit is
        deleted, the others keep their place. How many lost it."""
        removed = 0
        for k in keys:
            m = d.get(k)
            if m is None or not m & bit:
                continue
            removed += 1
            m &= ~bit
            if m:
                d[k] = m
            else:
                del d[k]
        return removed

    @staticmethod
    def match_runs(d: dict[Any, int], keys: Sequence[Any]) -> list[tuple[int, int]]:
        """The running AND of the leading keys' masks, up to the first absent key or
        empty AND, as (depth, bits lost there) pairs, then (length, bits left)."""
        out: list[tuple[int, int]] = []
        held: int | None = None
        depth = 0
        for k in keys:
            m = d.get(k)
            if m is None:
                break
            cur = m if held is None else held & m
            if not cur:
                break
            if held is not None and cur != held:
                out.append((depth, held ^ cur))
            held = cur
            depth += 1
        if held is not None:
            out.append((depth, held))
        return out

    @staticmethod
    def evict(
        ref: list[int], hash_of: list[Any], cached: dict[Any, int], blocks: Sequence[int]
    ) -> list[Any]:
        """Blocks taken for new content: each count becomes 1 and the hash each held (if
        any) is forgotten in both maps; those hashes, in block order."""
        out: list[Any] = []
        for b in blocks:
            ref[b] = 1
            h = hash_of[b]
            if h is None:
                continue
            out.append(h)
            hash_of[b] = None
            del cached[h]
        return out

    @staticmethod
    def register(
        cached: dict[Any, int],
        hash_of: list[Any],
        blocks: Sequence[int],
        hashes: Sequence[Any],
        lo: int,
        hi: int,
    ) -> list[int] | None:
        """`cached.setdefault(hashes[k], blocks[k])` for k in [lo, hi). If every hash was
        new, each block's `hash_of` is set and None returned; otherwise `hash_of` is left
        alone and the setdefault results are returned."""
        if lo < 0 or hi < lo or hi > len(blocks) or hi > len(hashes):
            raise ValueError("register: [lo, hi) outside the blocks or hashes")
        before = len(cached)
        got = list(map(cached.setdefault, hashes[lo:hi], blocks[lo:hi]))
        if len(cached) - before != hi - lo:
            return got
        for k in range(lo, hi):
            hash_of[blocks[k]] = hashes[k]
        return None

    @staticmethod
    def hash_run(parent: int, stream: int, start: int, count: int, step: int) -> list[int]:
        """The chain h_k = hash((h_{k-1}, stream, start + k * step)), k < count, from
        h_{-1} = parent."""
        h = parent
        return [h := hash((h, stream, off)) for off in range(start, start + count * step, step)]

    @staticmethod
    def set_bits(out: list[Any], mask: int, value: Any) -> None:
        """out[i] = value for every set bit i of `mask`, lowest first."""
        while mask:
            low = mask & -mask
            out[low.bit_length() - 1] = value
            mask ^= low

    @staticmethod
    def retain_uses(retained: dict[Any, list[Any]], hashes: Sequence[Any], use_at: Any) -> set[Any]:
        """One more use at `use_at` for each hash (a hash listed twice gets two): a new
        use list, or `use_at` sorted into the hash's list (after equal times). The
        hashes whose soonest use became sooner."""
        if retained.keys().isdisjoint(hashes):
            # Nothing of it retained yet (the common case): one new use list a hash, made
            # in C. A hash listed twice is left to the loop, which gives it two uses.
            fresh = dict(zip(hashes, map(list, repeat((use_at,), len(hashes))), strict=True))
            if len(fresh) == len(hashes):
                retained.update(fresh)
                return set()
        get = retained.get
        sooner: set[Any] = set()
        for h in hashes:
            uses = get(h)  # sorted: the first is the soonest
            if uses is None:
                retained[h] = [use_at]
            elif use_at < uses[0]:
                uses.insert(0, use_at)
                sooner.add(h)
            else:
                insort(uses, use_at)
        return sooner

    @staticmethod
    def release_uses(
        retained: dict[Any, list[Any]], hashes: Sequence[Any], use_at: Any
    ) -> tuple[list[Any], list[Any]]:
        """Undo one `retain_uses(retained, hashes, use_at)`: a hash whose last use this
        was is deleted; otherwise the use is taken out of its list. Returns the hashes
        deleted and those whose soonest use became later, in order."""
        uses_of = list(map(retained.get, hashes))
        if None not in uses_of and sum(map(len, uses_of)) == len(uses_of):  # type: ignore[arg-type]
            # This retention was the only holder of each (the common case): all go.
            # pop() with a default keeps a hash listed twice from failing.
            deque(map(retained.pop, hashes, repeat(None)), maxlen=0)
            return list(dict.fromkeys(hashes)), []
        gone: list[Any] = []
        moved: list[Any] = []
        get = retained.get
        for h in hashes:
            uses = get(h)  # sorted: the first is the soonest
            if uses is None:
                continue
            if len(uses) == 1:
                del retained[h]
                gone.append(h)
            elif uses[0] == use_at:
                del uses[0]
                if uses[0] != use_at:
                    moved.append(h)
            else:
                uses.remove(use_at)
        return gone, moved

    @staticmethod
    def free_cached(
        cached: dict[Any, int],
        ref: list[int],
        run_of: list[Any],
        hashes: Sequence[Any],
        want: type,
        also_type: type,
        also: set[Any] | None,
    ) -> list[int]:
        """The free blocks (count 0) holding these hashes whose queue run is of type
        `want` (or of `also_type`, for a hash in `also`), in hash order, each once."""
        seen: set[int] = set()
        out: list[int] = []
        # Most of a chain is held by running requests or not cached: look every hash up
        # in C and keep the free blocks in one pass before the per-block checks.
        blocks = list(map(cached.get, hashes))
        is_free = [b is not None and not ref[b] for b in blocks]
        pairs = cast(
            list[tuple[Any, int]], list(compress(zip(hashes, blocks, strict=True), is_free))
        )
        for h, b in pairs:
            if b in seen:
                continue
            kind = type(run_of[b])
            if kind is want or (also and kind is also_type and h in also):
                seen.add(b)
                out.append(b)
        return out


def block_ops() -> BlockOps:
    """The compiled operations when built (and not turned off), else the reference."""
    if os.environ.get("WASMA_BLOCKOPS", "") != "python":
        try:
            from wasma.core import _blockops  # type: ignore[attr-defined]
        except ImportError:
            pass
        else:
            return _blockops  # type: ignore[no-any-return]
    return PythonBlockOps()
