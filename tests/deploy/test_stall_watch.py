"""The stall check's watch: it ends a task's wait for its engine, and only its own
cancellation turns into a fault."""

from __future__ import annotations

import asyncio

import pytest

from wasma.deploy.live_request import StallWatch


async def _waiter() -> tuple[asyncio.Task[str], StallWatch]:
    """A task waiting as `EngineRunner.next_chunk` does, and its watch: it returns
    "fault" where the watch caught the cancellation, and is cancelled otherwise."""
    box: list[StallWatch] = []
    started = asyncio.Event()

    async def wait() -> str:
        task = asyncio.current_task()
        assert task is not None
        watch = StallWatch(task)
        box.append(watch)
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if watch.caught():
                return "fault"
            raise
        return "done"

    task = asyncio.ensure_future(wait())
    await started.wait()
    return task, box[0]


async def test_a_fired_watch_ends_the_wait_as_a_fault() -> None:
    task, watch = await _waiter()
    watch.fire()
    watch.fire()  # a second check before the task runs fires nothing more
    assert await task == "fault"
    assert task.cancelling() == 0  # its own cancellation taken back


async def test_another_cancellation_with_the_watch_still_cancels() -> None:
    task, watch = await _waiter()
    watch.fire()
    task.cancel()  # the client left too
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_plain_cancellation_is_not_a_fault() -> None:
    task, _ = await _waiter()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
