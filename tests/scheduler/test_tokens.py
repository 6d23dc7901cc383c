"""Token spans, block-hash chains and materialisation (core/tokens.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wasma.core.tokens import (
    ROOT_HASH,
    BlockHasher,
    Piece,
    TokenMaterialiser,
    hash_token_blocks,
    span_tokens,
    stream_id,
    truncate_span,
)

# -- helpers ---------------------------------------------------------------------------

# A "run" is a contiguous slice of one stream: (stream, start, length).
runs_st = st.lists(
    st.tuples(st.integers(1, 4), st.integers(0, 40), st.integers(1, 30)), min_size=1, max_size=6
)


def cut(runs: list[tuple[int, int, int]], cuts: list[int]) -> tuple[Piece, ...]:
    """The same token sequence as `runs`, cut into more pieces at the given offsets."""
    out: list[Piece] = []
    for i, (s, start, length) in enumerate(runs):
        k = cuts[i % len(cuts)] % length if cuts else 0
        if k:
            out.append(Piece(s, start, k))
            out.append(Piece(s, start + k, length - k))
        else:
            out.append(Piece(s, start, length))
    return tuple(out)


def token_list(span: tuple[Piece, ...]) -> list[tuple[int, int]]:
    """The span as a list of (stream, position) token identities."""
    return [(p.stream, p.start + i) for p in span for i in range(p.length)]


# -- spans -----------------------------------------------------------------------------


def test_span_tokens_and_truncate() -> None:
    span = (Piece(1, 0, 5), Piece(2, 10, 7), Piece(3, 0, 4))
    assert span_tokens(span) == 16
    assert truncate_span(span, 0) == ()
    assert truncate_span(span, 5) == (Piece(1, 0, 5),)
    assert truncate_span(span, 8) == (Piece(1, 0, 5), Piece(2, 10, 3))
    assert truncate_span(span, 100) == span


def test_stream_id_is_stable_and_distinct() -> None:
    assert stream_id("s", "doc:1") == stream_id("s", "doc:1")
    assert stream_id("s", "doc:1") != stream_id("s", "doc:2")
    # parts are separated: ("ab","c") is not ("a","bc")
    assert stream_id("ab", "c") != stream_id("a", "bc")
    assert 0 <= stream_id("x") < 2**63


# -- chain hashing ---------------------------------------------------------------------


def test_block_hasher_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(0)


def test_chain_counts_full_blocks_only() -> None:
    h = BlockHasher(4)
    assert h.chain(()) == []
    assert h.chain((Piece(1, 0, 3),)) == []
    assert len(h.chain((Piece(1, 0, 4),))) == 1
    assert len(h.chain((Piece(1, 0, 11),))) == 2
    assert len(h.chain((Piece(1, 0, 3), Piece(2, 0, 6)))) == 2


def test_chain_same_tokens_cut_differently_hash_equal() -> None:
    h = BlockHasher(4)
    whole = h.chain((Piece(7, 0, 12),))
    assert h.chain((Piece(7, 0, 3), Piece(7, 3, 9))) == whole
    assert h.chain((Piece(7, 0, 5), Piece(7, 5, 2), Piece(7, 7, 5))) == whole
    assert h.chain(tuple(Piece(7, i, 1) for i in range(12))) == whole


def test_chain_differs_for_different_tokens() -> None:
    h = BlockHasher(4)
    a = h.chain((Piece(1, 0, 8),))
    b = h.chain((Piece(2, 0, 8),))
    c = h.chain((Piece(1, 4, 8),))  # same stream, shifted
    assert a[0] != b[0] and a[0] != c[0]
    # a straddling block differs from a single-stream one
    d = h.chain((Piece(1, 0, 2), Piece(2, 0, 2)))
    assert d[0] != a[0]


def test_chain_is_a_chain_block_hash_depends_on_prefix() -> None:
    """Same block tokens after a different prefix hash differently (vLLM's parent chaining)."""
    h = BlockHasher(4)
    x = h.chain((Piece(1, 0, 4), Piece(9, 0, 4)))
    y = h.chain((Piece(2, 0, 4), Piece(9, 0, 4)))
    assert x[1] != y[1]


def test_chain_parent_argument_continues_a_chain() -> None:
    h = BlockHasher(4)
    full = h.chain((Piece(1, 0, 8), Piece(2, 0, 8)))
    head = h.chain((Piece(1, 0, 8),))
    tail = h.chain((Piece(2, 0, 8),), parent=head[-1])
    assert head + tail == full


def test_chain_memo_does_not_change_results() -> None:
    fresh = BlockHasher(4)
    used = BlockHasher(4)
    for _ in range(3):
        used.chain((Piece(5, 0, 40), Piece(6, 0, 17)))
    assert used.chain((Piece(5, 0, 40), Piece(6, 0, 17))) == fresh.chain(
        (Piece(5, 0, 40), Piece(6, 0, 17))
    )
    assert used.chain((Piece(5, 0, 40),), parent=123) == fresh.chain((Piece(5, 0, 40),), parent=123)


@settings(max_examples=150, deadline=None, database=None)
@given(runs=runs_st, cuts=st.lists(st.integers(0, 50), max_size=6), bs=st.integers(1, 8))
def test_chain_cut_invariance_property(
    runs: list[tuple[int, int, int]], cuts: list[int], bs: int
) -> None:
    whole = tuple(Piece(*r) for r in runs)
    again = cut(runs, cuts)
    assert token_list(whole) == token_list(again)
    assert BlockHasher(bs).chain(whole) == BlockHasher(bs).chain(again)


@settings(max_examples=150, deadline=None, database=None)
@given(runs=runs_st, extra=runs_st, bs=st.integers(1, 8))
def test_chain_prefix_property(
    runs: list[tuple[int, int, int]], extra: list[tuple[int, int, int]], bs: int
) -> None:
    """Block i's hash depends only on blocks <= i: appending tokens keeps earlier hashes."""
    a = tuple(Piece(*r) for r in runs)
    b = a + tuple(Piece(*r) for r in extra)
    ha, hb = BlockHasher(bs).chain(a), BlockHasher(bs).chain(b)
    assert len(ha) == span_tokens(a) // bs
    assert hb[: len(ha)] == ha
    # and truncating a span keeps the hashes of the kept full blocks
    n = span_tokens(b) // 2
    assert BlockHasher(bs).chain(truncate_span(b, n)) == hb[: n // bs]


@settings(max_examples=100, deadline=None, database=None)
@given(runs=runs_st, bs=st.integers(1, 6))
def test_chain_agrees_with_token_identity(runs: list[tuple[int, int, int]], bs: int) -> None:
    """Two spans have equal block hashes exactly where their token prefixes are equal."""
    a = tuple(Piece(*r) for r in runs)
    b = (Piece(1, 0, 5), *a)
    ha, hb = BlockHasher(bs).chain(a), BlockHasher(bs).chain(b)
    ta, tb = token_list(a), token_list(b)
    for i in range(min(len(ha), len(hb))):
        same = ta[: (i + 1) * bs] == tb[: (i + 1) * bs]
        assert (ha[i] == hb[i]) == same


def test_chain_ignores_zero_length_pieces() -> None:
    h = BlockHasher(4)
    assert h.chain((Piece(1, 0, 2), Piece(2, 0, 0), Piece(1, 2, 2))) == h.chain((Piece(1, 0, 4),))


# -- real token ids --------------------------------------------------------------------


def test_hash_token_blocks_basic() -> None:
    toks = list(range(100, 110))
    hs = hash_token_blocks(toks, 4)
    assert len(hs) == 2
    assert all(0 <= h < 2**63 for h in hs)
    assert hash_token_blocks(toks, 4) == hs
    assert hash_token_blocks([], 4) == []


@settings(max_examples=100, deadline=None, database=None)
@given(
    prefix=st.lists(st.integers(0, 2**31), max_size=40),
    a=st.lists(st.integers(0, 2**31), max_size=20),
    b=st.lists(st.integers(0, 2**31), max_size=20),
    bs=st.integers(1, 8),
)
def test_hash_token_blocks_equal_for_equal_prefixes(
    prefix: list[int], a: list[int], b: list[int], bs: int
) -> None:
    ha = hash_token_blocks(prefix + a, bs)
    hb = hash_token_blocks(prefix + b, bs)
    full = len(prefix) // bs
    assert ha[:full] == hb[:full]
    for i in range(min(len(ha), len(hb))):
        same = (prefix + a)[: (i + 1) * bs] == (prefix + b)[: (i + 1) * bs]
        assert (ha[i] == hb[i]) == same


def test_hash_token_blocks_chains_from_parent() -> None:
    toks = list(range(16))
    head = hash_token_blocks(toks[:8], 4)
    assert hash_token_blocks(toks[8:], 4, parent=head[-1]) == hash_token_blocks(toks, 4)[2:]
    assert hash_token_blocks(toks, 4, parent=ROOT_HASH) == hash_token_blocks(toks, 4)


def test_hash_token_blocks_order_matters() -> None:
    assert hash_token_blocks([1, 2, 3, 4], 4) != hash_token_blocks([4, 3, 2, 1], 4)


# -- materialisation -------------------------------------------------------------------


def test_materialiser_rejects_tiny_vocab() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        TokenMaterialiser(16, low=16)


def test_materialise_deterministic_and_in_range() -> None:
    span = (Piece(11, 0, 50), Piece(12, 30, 200), Piece(11, 50, 10))
    a = TokenMaterialiser(1000).materialise(span)
    b = TokenMaterialiser(1000).materialise(span)
    assert a == b
    assert len(a) == 260
    assert all(16 <= t < 1000 for t in a)
    assert all(isinstance(t, int) for t in a)
    assert TokenMaterialiser(1000).materialise(()) == []


def test_materialise_low_bound_respected() -> None:
    toks = TokenMaterialiser(40, low=30).materialise((Piece(3, 0, 500),))
    assert min(toks) >= 30 and max(toks) < 40
    assert len(set(toks)) > 1


def test_materialise_stream_prefix_stable_when_stream_grows() -> None:
    m = TokenMaterialiser(5000)
    short = m.materialise((Piece(9, 0, 10),))
    m.materialise((Piece(9, 0, 5000),))  # grows the cached stream
    assert m.materialise((Piece(9, 0, 10),)) == short
    # and a fresh materialiser, asked for the long one first, agrees
    fresh = TokenMaterialiser(5000)
    assert fresh.materialise((Piece(9, 0, 5000),))[:10] == short


def test_materialise_slices_match_stream_positions() -> None:
    m = TokenMaterialiser(5000)
    whole = m.materialise((Piece(4, 0, 100),))
    assert m.materialise((Piece(4, 20, 30),)) == whole[20:50]
    assert m.materialise((Piece(4, 0, 20), Piece(4, 20, 80))) == whole


@settings(max_examples=60, deadline=None, database=None)
@given(runs=runs_st, cuts=st.lists(st.integers(0, 50), max_size=6), bs=st.integers(1, 8))
def test_materialised_tokens_hash_equal_iff_span_hash_equal(
    runs: list[tuple[int, int, int]], cuts: list[int], bs: int
) -> None:
    """Cutting a span differently changes neither the tokens nor the token-level hashes."""
    m = TokenMaterialiser(50_000)
    whole = tuple(Piece(*r) for r in runs)
    again = cut(runs, cuts)
    ta, tb = m.materialise(whole), m.materialise(again)
    assert ta == tb
    assert hash_token_blocks(ta, bs) == hash_token_blocks(tb, bs)


def test_distinct_streams_materialise_differently() -> None:
    m = TokenMaterialiser(128_256)
    a = np.array(m.materialise((Piece(stream_id("s", "a"), 0, 64),)))
    b = np.array(m.materialise((Piece(stream_id("s", "b"), 0, 64),)))
    assert (a != b).mean() > 0.9
