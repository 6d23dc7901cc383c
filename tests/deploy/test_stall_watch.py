"""The stall check's watch: it ends a task's wait for its engine, and only its own
cancellation turns into a fault."""

from __future__ import annotations

import asyncio

import pytest

from wasma.deploy.live_request import StallWatch


async def _wait_and_classify(watch_box: list[StallWatch], started: asyncio.Event) -> str:
    task = asyncio.current_task()
    assert task is not None
    watch = StallWatch(task)
    watch_box.append(watch)
    started.set()
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        if watch.caught():
            return "fault"
        raise
    return "done"


@pytest.mark.asyncio
async def test_a_fired_watch_ends_the_wait_as_a_fault() -> None:
    box: list[StallWatch] = []
    started = asyncio.Event()
    task = asyncio.ensure_future(_wait_and_classify(box, started))
    await started.wait()
    box[0].fire()
    box[0].fire()  # a second check before the task runs fires nothing more
    assert await task == "fault"
    assert task.cancelling() == 0  # its own cancellation taken back


@pytest.mark.asyncio
async def test_another_cancellation_with_the_watch_still_cancels() -> None:
    box: list[StallWatch] = []
    started = asyncio.Event()
    task = asyncio.ensure_future(_wait_and_classify(box, started))
    await started.wait()
    box[0].fire()
    task.cancel()  # the client left too
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.asyncio
async def test_a_plain_cancellation_is_not_a_fault() -> None:
    box: list[StallWatch] = []
    started = asyncio.Event()
    task = asyncio.ensure_future(_wait_and_classify(box, started))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
