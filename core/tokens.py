"""Token streams, prompt spans and vLLM-style block-hash chains.

A prompt is described as a tuple of `Piece`s: slices of deterministic token streams
(a shared system prompt, a document, a node's output). The simulator hashes pieces
without materialising tokens; real engines get the tokens from `materialise`. Both
produce a *chain* of block hashes where block i's hash folds in block i-1's hash, as
vLLM's prefix cache does, so a hash identifies a whole prefix, not just one block.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from wasma.core.blockops import BlockOps, block_ops

ROOT_HASH = 0
"""Parent of the first block (vLLM's NONE_HASH plays this role)."""

# The memo keeps hash chains of whole aligned pieces (system prompts, documents,
# contexts children repeat); clearing it when it holds this many hashes bounds memory on
# long runs (a document's chain is hundreds of hashes, so count hashes, not entries).
_MEMO_CAP_HASHES = 2_000_000


def stream_id(*parts: str) -> int:
    """A stable 63-bit id for a token stream (Python's str hash is salted per process)."""
    digest = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True, slots=True)
class Piece:
    """`length` tokens of stream `stream`, starting at token `start` of that stream."""

    stream: int
    start: int
    length: int


Span = tuple[Piece, ...]


def span_tokens(span: Iterable[Piece]) -> int:
    return sum(p.length for p in span)


def truncate_span(span: Sequence[Piece], n_tokens: int) -> Span:
    """The first `n_tokens` tokens of `span`."""
    out: list[Piece] = []
    left = n_tokens
    for p in span:
        if left <= 0:
            break
        take = min(p.length, left)
        out.append(p if take == p.length else Piece(p.stream, p.start, take))
        left -= take
    return tuple(out)


class BlockHasher:
    """Computes block-hash chains of spans for one block size.

    A block lying inside one stream hashes as `(parent, stream, offset)`; a block that
    straddles pieces hashes its normalised list of `(stream, start, length)` runs, so
    the same tokens always give the same hash however the span was cut.
    """

    def __init__(self, block_size: int, ops: BlockOps | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._ops = ops if ops is not None else block_ops()
        self._memo: dict[tuple[int, int, int, int], tuple[tuple[int, ...], int]] = {}
        self._memo_hashes = 0

    def chain(self, span: Sequence[Piece], parent: int = ROOT_HASH) -> list[int]:
        """Hashes of every *full* block of `span`, chained from `parent`."""
        bs = self.block_size
        out: list[int] = []
        carry: list[tuple[int, int, int]] = []
        carry_len = 0
        for p in span:
            if not p.length:
                continue  # an empty piece adds no tokens; it must not split a block's runs
            stream, pos, left = p.stream, p.start, p.length
            if carry_len:
                take = min(bs - carry_len, left)
                last = carry[-1]
                if last[0] == stream and last[1] + last[2] == pos:
                    carry[-1] = (stream, last[1], last[2] + take)
                else:
                    carry.append((stream, pos, take))
                carry_len += take
                pos += take
                left -= take
                if carry_len == bs:
                    parent = self._block(parent, carry)
                    out.append(parent)
                    carry, carry_len = [], 0
            if left >= bs:
                key = (parent, stream, pos, left)
                hit = self._memo.get(key)
                if hit is None:
                    hashes = self._ops.hash_run(parent, stream, pos, left // bs, bs)
                    if self._memo_hashes + len(hashes) > _MEMO_CAP_HASHES:
                        self._memo.clear()
                        self._memo_hashes = 0
                    hit = (tuple(hashes), hashes[-1])
                    self._memo[key] = hit
                    self._memo_hashes += len(hashes)
                out.extend(hit[0])
                parent = hit[1]
                full = (left // bs) * bs
                pos += full
                left -= full
            if left:
                carry.append((stream, pos, left))
                carry_len += left
        return out

    @staticmethod
    def _block(parent: int, runs: list[tuple[int, int, int]]) -> int:
        if len(runs) == 1:
            return hash((parent, runs[0][0], runs[0][1]))
        return hash((parent, tuple(runs)))


def hash_token_blocks(tokens: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Block-hash chain over real token ids (the live path, where tokens are known)."""
    out: list[int] = []
    arr = np.asarray(tokens, dtype=np.int64)
    for i in range(0, (len(arr) // block_size) * block_size, block_size):
        h = hashlib.blake2b(digest_size=8)
        h.update(parent.to_bytes(8, "little", signed=False))
        h.update(arr[i : i + block_size].tobytes())
        parent = int.from_bytes(h.digest(), "little") >> 1
        out.append(parent)
    return out


class TokenMaterialiser:
    """Turns spans into token ids, deterministically, for a vocabulary.

    Ids are drawn from `[low, vocab_size)` so special tokens (BOS/EOS/PAD, which
    tokenizers put at the bottom of the vocabulary) never appear in a prompt.
    """

    def __init__(self, vocab_size: int, low: int = 16) -> None:
        if vocab_size <= low:
            raise ValueError(f"vocab_size {vocab_size} must exceed the reserved range {low}")
        self.vocab_size = vocab_size
        self.low = low
        self._streams: dict[int, np.ndarray] = {}

    def stream(self, stream: int, length: int) -> np.ndarray:
        have = self._streams.get(stream)
        if have is None or len(have) < length:
            # Regenerate from the seed so prefixes stay identical when a stream grows.
            rng = np.random.Generator(np.random.PCG64(stream))
            have = rng.integers(self.low, self.vocab_size, size=max(length, 64), dtype=np.int64)
            self._streams[stream] = have
        return have[:length]

    def materialise(self, span: Iterable[Piece]) -> list[int]:
        parts = [self.stream(p.stream, p.start + p.length)[p.start :] for p in span]
        if not parts:
            return []
        return [int(t) for t in np.concatenate(parts)]
