"""The copy schedule: copies queue on their source's link, and a broadcast grows in flight."""

from __future__ import annotations

import pytest

from wasma.scheduler.copies import CopySchedule
from wasma.scheduler.pricing import DeviceMappedPricer, hgx_devices
from wasma.transfer import BandwidthPricer, Planner, build_preset

# 1 GB/s and 1 ms a destination: a 100 MB copy takes 0.101 s, to two destinations 0.102 s.
PRICER = BandwidthPricer(1e9, latency_s=1e-3)
MB100 = 100_000_000
ONE = 0.101
CHAIN = list(range(1000, 1064))


def test_copies_from_one_engine_queue_on_its_link() -> None:
    book = CopySchedule(PRICER, relay=False)
    a = book.book("e0", "e1", CHAIN, 64, MB100, 0.0)
    b = book.book("e0", "e2", CHAIN, 64, MB100, 0.0)
    assert (a.ready_s, a.joined) == (pytest.approx(ONE), False)
    assert (b.ready_s, b.joined) == (pytest.approx(2 * ONE), False)
    assert book.free_s("e0") == pytest.approx(2 * ONE)


def test_copies_from_different_engines_do_not_wait_for_each_other() -> None:
    book = CopySchedule(PRICER, relay=False)
    book.book("e0", "e1", CHAIN, 64, MB100, 0.0)
    other = book.book("e3", "e2", CHAIN, 64, MB100, 0.0)
    assert other.ready_s == pytest.approx(ONE)
    assert book.free_s("e1") == 0.0  # never a source


def test_a_copy_booked_after_the_link_is_free_starts_then() -> None:
    book = CopySchedule(PRICER, relay=True)
    book.book("e0", "e1", CHAIN, 64, MB100, 0.0)
    later = book.book("e0", "e2", CHAIN, 64, MB100, 5.0)
    assert (later.ready_s, later.joined) == (pytest.approx(5.0 + ONE), False)


def test_with_relays_a_second_destination_joins_the_broadcast_in_flight() -> None:
    book = CopySchedule(PRICER, relay=True)
    book.book("e0", "e1", CHAIN, 64, MB100, 0.0)
    joined = book.book("e0", "e2", CHAIN, 64, MB100, 0.05)
    # From the group's start: one copy's bytes plus a hop a destination.
    assert (joined.ready_s, joined.joined) == (pytest.approx(0.102), True)
    assert book.free_s("e0") == pytest.approx(0.102)
    third = book.book("e0", "e3", CHAIN, 64, MB100, 0.1)
    assert third.ready_s == pytest.approx(0.103)


def test_broadcast_off_queues_even_where_engines_relay() -> None:
    book = CopySchedule(PRICER, relay=True)
    book.book("e0", "e1", CHAIN, 64, MB100, 0.0)
    queued = book.book("e0", "e2", CHAIN, 64, MB100, 0.0, broadcast=False)
    assert (queued.ready_s, queued.joined) == (pytest.approx(2 * ONE), False)


def test_only_the_same_prefix_joins() -> None:
    book = CopySchedule(PRICER, relay=True)
    book.book("e0", "e1", CHAIN, 64, MB100, 0.0)
    other = [7, *CHAIN[1:]]  # another chain: every hash after a differing block differs
    other[-1] = -1
    assert not book.joinable("e0", other, 64, 0.0)
    assert book.joinable("e0", CHAIN[:32], 32, 0.0)  # a prefix of what is moving
    assert not book.joinable("e0", [*CHAIN, 5], 65, 0.0)  # more than is moving
    assert book.book("e0", "e2", other, 64, MB100, 0.0).ready_s == pytest.approx(2 * ONE)


def test_a_finished_broadcast_or_one_queued_behind_is_not_joinable() -> None:
    book = CopySchedule(PRICER, relay=True)
    book.book("e0", "e1", CHAIN, 64, MB100, 0.0)
    assert not book.joinable("e0", CHAIN, 64, ONE)  # landed: copy afresh
    book = CopySchedule(PRICER, relay=True)
    book.book("e0", "e1", CHAIN, 64, MB100, 0.0)
    book.book("e0", "e2", [9] * 64, 64, MB100, 0.0)  # another prefix queued behind it
    # Growing the first group would delay the copy booked after it.
    assert not book.joinable("e0", CHAIN, 64, 0.0)
    assert book.book("e0", "e3", CHAIN, 64, MB100, 0.0).ready_s == pytest.approx(3 * ONE)


def test_a_destination_already_in_the_group_costs_nothing_more() -> None:
    book = CopySchedule(PRICER, relay=True)
    book.book("e0", "e1", CHAIN, 64, MB100, 0.0)
    again = book.book("e0", "e1", CHAIN, 64, MB100, 0.01)
    assert (again.ready_s, again.joined) == (pytest.approx(ONE), True)
    assert book.free_s("e0") == pytest.approx(ONE)


def test_quote_books_nothing() -> None:
    book = CopySchedule(PRICER, relay=True)
    book.book("e0", "e1", CHAIN, 64, MB100, 0.0)
    q = book.quote("e0", "e2", CHAIN, 64, MB100, 0.0)
    assert book.quote("e0", "e2", CHAIN, 64, MB100, 0.0) == q
    assert book.free_s("e0") == pytest.approx(ONE)
    assert book.book("e0", "e2", CHAIN, 64, MB100, 0.0) == q


def test_on_a_pcie_box_a_broadcast_to_seven_beats_seven_queued_copies() -> None:
    """With the planner's prices: one chain through the box, not seven copies in a row."""
    names = [f"e{i}" for i in range(8)]
    pricer = DeviceMappedPricer(Planner(build_preset("pcie-8")), hgx_devices(names))
    size = 900_000_000  # a 7k-token llama3-8b prefix
    ready = {}
    for relay in (False, True):
        book = CopySchedule(pricer, relay=relay)
        ready[relay] = max(
            book.book("e0", f"e{i}", CHAIN, 64, size, 0.0).ready_s for i in range(1, 8)
        )
    one = pricer.estimate_s("e0", ["e1"], size)
    assert ready[False] == pytest.approx(7 * one, rel=1e-3)  # paths differ a little
    assert ready[True] < 1.5 * one
