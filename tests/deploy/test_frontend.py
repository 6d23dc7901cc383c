"""vLLM's front end in the gateway: small requests render on the event loop."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from wasma.deploy.frontend import INLINE_BODY_BYTES, InlineWhenSmall


def test_small_work_runs_inline_and_the_rest_on_the_pool() -> None:
    pool = ThreadPoolExecutor(max_workers=1)
    ex = InlineWhenSmall(pool)
    here = threading.get_ident()
    try:
        assert ex.submit(threading.get_ident).result() != here  # not marked: the pool
        token = ex.small.set(True)
        try:
            assert ex.submit(threading.get_ident).result() == here
            failed = ex.submit(int, "x")  # an error reaches the caller, as from the pool
            with pytest.raises(ValueError):
                failed.result()
        finally:
            ex.small.reset(token)
        assert ex.submit(threading.get_ident).result() != here
    finally:
        ex.shutdown()


def test_a_small_request_renders_on_the_loop_to_the_same_ids(sim_frontend: Any) -> None:
    """vLLM 0.32's renderer takes the wrapper (the optimisation is on), and a request
    rendered inline gets exactly the ids and parameters the threaded render gives,
    without a hand-off through the loop's executor machinery; a large one stays on the
    renderer's threads."""
    from wasma.deploy.api import render

    fe = sim_frontend
    assert fe._inline is not None
    body = {
        "model": "wasma-sim",
        "messages": [{"role": "user", "content": "the planner reads the plan"}],
        "max_tokens": 5,
    }
    threads: list[int] = []
    pool_submit = fe._inline.pool.submit

    def counting(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return pool_submit(fn, *args, **kwargs)

    fe._inline.pool.submit = counting
    try:

        async def both() -> tuple[Any, Any, Any]:
            loop = asyncio.get_running_loop()
            handoffs: list[Any] = []
            run_in_executor = loop.run_in_executor

            def counted(executor: Any, func: Any, *args: Any) -> Any:
                handoffs.append(func)
                return run_in_executor(executor, func, *args)

            loop.run_in_executor = counted  # type: ignore[method-assign]
            threaded = await render(fe, "chat", dict(body))
            calls, before = len(threads), len(handoffs)
            assert before >= 2  # the chat template and the tokenizer, as vLLM runs them
            with fe.inline(200):
                inline = await render(fe, "chat", dict(body))
            assert len(threads) == calls  # nothing went to the pool
            # vLLM's wrappers answered with settled futures: no executor hand-off at all.
            assert len(handoffs) == before
            with fe.inline(INLINE_BODY_BYTES + 1):
                large = await render(fe, "chat", dict(body))
            assert len(threads) > calls
            return threaded, inline, large

        threaded, inline, large = asyncio.run(both())
    finally:
        del fe._inline.pool.submit
    assert threaded.token_ids == inline.token_ids == large.token_ids
    assert inline.generate[0].sampling_params == threaded.generate[0].sampling_params


def test_a_small_text_chat_renders_without_tasks_and_media_keeps_the_async_steps(
    sim_frontend: Any,
) -> None:
    """Inline, a text-only chat goes through the renderer's synchronous `render_chat`
    (no task made for its steps) to the same ids as the async steps; a chat with an
    image part keeps the async steps, which fetch media without blocking the loop."""
    from wasma.deploy.api import render
    from wasma.deploy.frontend import _text_only

    fe = sim_frontend
    parts = [{"type": "text", "text": "the planner"}, {"type": "text", "text": " reads"}]
    body = {
        "model": "wasma-sim",
        "messages": [
            {"role": "system", "content": "plan"},
            {"role": "user", "content": parts},
            {"role": "assistant", "content": None, "tool_calls": []},
        ],
        "max_tokens": 5,
    }

    async def counted(inline: bool) -> tuple[Any, int]:
        loop = asyncio.get_running_loop()
        made = 0
        factory = loop.get_task_factory()

        def counting(loop: Any, coro: Any, **kwargs: Any) -> Any:
            nonlocal made
            made += 1
            if factory is not None:
                return factory(loop, coro, **kwargs)
            return asyncio.Task(coro, loop=loop, **kwargs)

        loop.set_task_factory(counting)
        try:
            if inline:
                with fe.inline(200):
                    return await render(fe, "chat", dict(body)), made
            return await render(fe, "chat", dict(body)), made
        finally:
            loop.set_task_factory(factory)

    threaded, tasks_threaded = asyncio.run(counted(False))
    inline, tasks_inline = asyncio.run(counted(True))
    assert tasks_threaded >= 3 and tasks_inline == 0
    assert inline.token_ids == threaded.token_ids
    assert inline.generate[0].sampling_params == threaded.generate[0].sampling_params
    image = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}
    assert _text_only([body["messages"]])
    assert not _text_only([[{"role": "user", "content": [parts[0], image]}]])
    assert not _text_only([[{"role": "user", "content": ("tuple",)}]])
