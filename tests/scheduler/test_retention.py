"""The router's record of which retentions are still wanted (scheduler/retention.py)."""

from __future__ import annotations

from wasma.scheduler.retention import RetentionTracker
from wasma.scheduler.workflow import ContextOf, Node, OutputOf, Unique, Workflow


def _mapreduce() -> Workflow:
    return Workflow.create(
        "w",
        "x",
        0.0,
        60.0,
        [
            Node("plan", (), 8, (Unique(64),)),
            Node("a", ("plan",), 8, (ContextOf("plan"), Unique(8))),
            Node("b", ("plan",), 8, (ContextOf("plan"), Unique(8))),
            Node("join", ("a", "b"), 8, (OutputOf("a"), OutputOf("b"))),
        ],
    )


def test_a_retention_is_released_on_its_engine_once_every_reader_started() -> None:
    wf, t = _mapreduce(), RetentionTracker()
    assert wf.context_readers("plan") == ("a", "b") and wf.context_readers("a") == ()
    t.placed(wf, "w", "plan", "r-plan", 3, retain=True)
    t.placed(wf, "w", "a", "r-a", 1, retain=False)
    t.placed(wf, "w", "b", "r-b", 3, retain=False)
    t.started("r-plan")  # reads nothing retained
    t.started("r-a")
    assert t.take(3) == () and len(t) == 1  # b has not started
    t.started("r-b")
    assert t.take(1) == ()
    assert t.take(3) == ("r-plan",)
    assert t.take(3) == ()  # once
    t.started("r-b")  # a repeat changes nothing
    assert len(t) == 0


def test_nothing_is_tracked_for_a_dag_node_without_readers() -> None:
    wf, t = _mapreduce(), RetentionTracker()
    t.placed(wf, "w", "join", "r-join", 0, retain=True)  # nobody extends the reducer
    assert len(t) == 0


def test_without_a_dag_the_requests_naming_it_are_its_readers() -> None:
    """No DAG: the requests extending its prompt are its readers, counted as they arrive.
    Siblings are ready together, so once one of them has finished, the retention ends
    when every reader seen has started."""
    t = RetentionTracker()
    t.placed(None, "w", "plan", "r-plan", 2, retain=True)
    t.started("r-plan")
    t.finished("r-plan")  # its own end releases nothing: no reader yet
    t.placed(None, "w", "a", "r-a", 2, retain=False, extends=("plan",))
    t.placed(None, "w", "b", "r-b", 1, retain=False, extends=("plan",))
    t.placed(None, "w", "c", "r-c", 1, retain=False, extends=("other",))  # not a reader
    t.started("r-a")
    t.started("r-b")
    assert t.take(2) == ()  # every reader seen started, but more may be on their way
    t.finished("r-c")
    assert t.take(2) == ()
    t.finished("r-a")
    assert t.take(2) == ("r-plan",) and len(t) == 0
    t.finished("r-b")  # later ends change nothing
    assert t.take(2) == ()


def test_without_a_dag_a_reader_still_waiting_keeps_it() -> None:
    t = RetentionTracker()
    t.placed(None, "w", "plan", "r-plan", 0, retain=True)
    t.placed(None, "w", "a", "r-a", 0, retain=False, extends=("plan",))
    t.placed(None, "w", "b", "r-b", 0, retain=False, extends=("plan",))
    t.started("r-a")
    t.finished("r-a")
    assert t.take(0) == ()  # b has not started: it still needs the KV
    t.placed(None, "w", "b", "r-b", 1, retain=False, extends=("plan",))  # a failover
    t.started("r-b")
    assert t.take(0) == ("r-plan",)
    # A retention nobody reads is left to its lease.
    t.placed(None, "w2", "plan", "r2", 0, retain=True)
    assert len(t) == 1 and t.take(0) == ()


def test_a_lost_engine_drops_what_it_kept_and_what_was_queued_for_it() -> None:
    wf, t = _mapreduce(), RetentionTracker()
    t.placed(wf, "w", "plan", "r-plan", 2, retain=True)
    t.placed(wf, "w", "a", "r-a", 2, retain=False)
    t.placed(wf, "w", "b", "r-b", 2, retain=False)
    t.started("r-a")
    t.started("r-b")
    t.engine_lost(2)
    assert t.take(2) == ()
    other = RetentionTracker()
    other.placed(wf, "w", "plan", "r-plan", 2, retain=True)
    other.engine_lost(2)
    assert len(other) == 0


def test_the_records_stay_bounded() -> None:
    t = RetentionTracker()
    t.MAX_TRACKED = 3
    t.MAX_PENDING = 2
    wf = _mapreduce()
    for i in range(5):
        t.placed(wf, f"w{i}", "plan", f"r{i}", 0, retain=True)
    assert len(t) == 3  # the oldest two forgotten: their leases end them
    for i in range(2, 5):
        for node in ("a", "b"):
            t.placed(wf, f"w{i}", node, f"r{i}{node}", 0, retain=False)
            t.started(f"r{i}{node}")
    assert t.take(0) == ("r3", "r4")
