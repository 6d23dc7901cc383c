"""vLLM's own front end, in the gateway's process: renderer, derenderer, tokenizer.

The gateway speaks the API through vLLM's serving classes, never a copy of the protocol:
`ServingRender` turns a chat, completion, Responses or Messages request into the token
ids and sampling parameters vLLM's engine would get (the ids placement hashes, exactly
the ids the engine caches), `ServingDerender` turns token ids back into vLLM's answer,
chunk by chunk, and `ServingTokenization` answers `/tokenize` and `/detokenize`. They are
built the way `vllm launch render` builds them (`init_render_app_state`), from the same
flags `vllm serve` takes, so a model directory and its chat template, tool parser and
reasoning parser give the same prompts here as on the engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

from .prompt_segments import install as install_prompt_segments

log = logging.getLogger(__name__)

# Request bodies up to this size render on the event loop (`Frontend.inline`).
INLINE_BODY_BYTES = 16 * 1024


class InlineWhenSmall(Executor):
    """The pool vLLM's renderer runs its chat template, tokenizer and detokenizer on,
    run inline for small requests. vLLM hands each of those calls to a thread so a long
    prompt does not stall the event loop; for a short one the two thread hand-offs of a
    chat render cost more than the work (measured: 800 against 500 us a render of a
    one-line chat on the tiny model). A request marks itself small (`inline`) for the
    calls made in its own task; everything else goes to the pool as before."""

    def __init__(self, pool: Executor) -> None:
        self.pool = pool
        self.small: contextvars.ContextVar[bool] = contextvars.ContextVar(
            "wasma_inline_render", default=False
        )

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        if not self.small.get():
            return self.pool.submit(fn, *args, **kwargs)
        done: Future[Any] = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the awaiting caller, as the pool would
            done.set_exception(exc)
        return done

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.pool.shutdown(wait=wait, cancel_futures=cancel_futures)


class FrontendError(ValueError):
    """The front end cannot be built from these options (one line, names the flag)."""


@dataclass(frozen=True)
class FrontendOptions:
    """What `vllm serve` is told about the model's front end, named as it names it."""

    model: str
    served_model_name: tuple[str, ...] = ()
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None
    enable_auto_tool_choice: bool = False
    max_model_len: int | None = None
    # Usage reports the prefix-cache hit (`prompt_tokens_details`), as `vllm serve
    # --enable-prompt-tokens-details` does: on in wasma, whose placement reports read it.
    prompt_tokens_details: bool = True

    def vllm_args(self) -> list[str]:
        """These options as `vllm serve` command-line flags."""
        args = ["--model", self.model]
        if self.served_model_name:
            args += ["--served-model-name", *self.served_model_name]
        if self.tool_call_parser:
            args += ["--tool-call-parser", self.tool_call_parser]
        if self.reasoning_parser:
            args += ["--reasoning-parser", self.reasoning_parser]
        if self.chat_template:
            args += ["--chat-template", self.chat_template]
        if self.enable_auto_tool_choice:
            args.append("--enable-auto-tool-choice")
        if self.max_model_len is not None:
            args += ["--max-model-len", str(self.max_model_len)]
        return args


class Frontend:
    """vLLM's serving objects for one model (build with `await Frontend.build(...)`)."""

    def __init__(self, state: Any, options: FrontendOptions) -> None:
        self.options = options
        self.render = state.serving_render
        self.derender = state.serving_derender
        self.tokenization = state.serving_tokenization
        self.models = state.openai_serving_models
        renderer = state.online_renderer
        self.model_config = renderer.model_config
        self.renderer = renderer.renderer  # vLLM's renderer: tokenizer, token id checks
        self.tokenizer = renderer.renderer.get_tokenizer()
        self.has_parser = renderer.parser is not None
        # Before the inline wrappers, which wrap the tokenize function installed here.
        self.segments = install_prompt_segments(renderer.renderer)
        self._inline = _install_inline(renderer.renderer)

    @contextlib.contextmanager
    def inline(self, body_bytes: int) -> Iterator[None]:
        """Within this block (the current task), a request of `body_bytes` renders and
        derenders on the event loop if it is small (`InlineWhenSmall`)."""
        if self._inline is None or body_bytes > INLINE_BODY_BYTES:
            yield
            return
        token = self._inline.small.set(True)
        try:
            yield
        finally:
            self._inline.small.reset(token)

    @property
    def model_name(self) -> str:
        name: str = self.models.model_name()
        return name

    @property
    def max_model_len(self) -> int:
        return int(self.model_config.max_model_len)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @classmethod
    async def build(cls, options: FrontendOptions) -> Frontend:
        """Parse `options` with `vllm serve`'s own parser and build the render state.
        Loading the tokenizer and template takes seconds: it runs on a worker thread."""
        return await asyncio.to_thread(_build_sync, options)

    @classmethod
    def build_sync(cls, options: FrontendOptions) -> Frontend:
        """`build` for callers with no event loop running (a Ray actor's thread)."""
        return _build_sync(options)


def _install_inline(renderer: Any) -> InlineWhenSmall | None:
    """Wrap the pool of vLLM 0.32's renderer (`BaseRenderer._executor._inner`, the pool
    its `make_async` wrappers submit to); None, and threads as before, where it is not
    there. vLLM swaps the pool out after a stuck render, dropping the wrapper with it."""
    executor = getattr(renderer, "_executor", None)
    pool = getattr(executor, "_inner", None)
    if not isinstance(pool, Executor):
        log.debug("vLLM's renderer has no swappable pool: renders stay on threads")
        return None
    inline = InlineWhenSmall(pool)
    executor._inner = inline  # type: ignore[union-attr]
    for name in _ASYNC_WRAPPERS:
        wrapper = getattr(renderer, name, None)
        func = _made_async(wrapper)
        if wrapper is not None and func is not None:
            setattr(renderer, name, _settled_when_small(wrapper, func, inline.small))
    render_async = getattr(renderer, "render_chat_async", None)
    render_sync = getattr(renderer, "render_chat", None)
    if callable(render_async) and callable(render_sync):
        renderer.render_chat_async = _chat_sync_when_small(render_async, render_sync, inline.small)
    return inline


def _chat_sync_when_small(
    render_async: Callable[..., Any],
    render_sync: Callable[..., Any],
    small: contextvars.ContextVar[bool],
) -> Callable[..., Any]:
    """vLLM's `render_chat_async`, except that a small text-only chat is rendered by the
    renderer's own synchronous `render_chat` (the same steps: template, tokenize,
    engine input). The async one gathers each step's coroutines as tasks, three a chat,
    each one more turn of the loop, which for a render already run inline buy nothing.
    A chat with any part but text keeps the async steps: they fetch media without
    blocking the loop."""

    async def call(conversations: Any, *args: Any, **kwargs: Any) -> Any:
        if small.get() and _text_only(conversations):
            return render_sync(conversations, *args, **kwargs)
        return await render_async(conversations, *args, **kwargs)

    return call


def _text_only(conversations: Any) -> bool:
    """Every message's content is text: a string, nothing, or parts of type text."""
    for conversation in conversations:
        for message in conversation:
            if not isinstance(message, dict):
                return False
            content = message.get("content")
            if content is None or isinstance(content, str):
                continue
            if not isinstance(content, list):
                return False
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    return False
    return True


# vLLM's `make_async` wrappers on its renderer (vllm/renderers/base.py, hf.py). Each
# goes through `loop.run_in_executor`, whose future settles by `call_soon_threadsafe`
# (a wake-up write and one more turn of the loop) even when the pool ran the call
# inline: three of them a chat render.
_ASYNC_WRAPPERS = (
    "_apply_chat_template_async",
    "_tokenize_prompt_async",
    "_async_tokenizer_decode",
)


def _made_async(wrapper: Any) -> Callable[..., Any] | None:
    """The blocking function a `make_async` wrapper runs, or None if `wrapper` is not
    one (another vLLM version: the pool alone then keeps small renders inline)."""
    code = getattr(wrapper, "__code__", None)
    cells = getattr(wrapper, "__closure__", None)
    if code is None or not cells or getattr(wrapper, "__name__", "") != "_async_wrapper":
        return None
    free = dict(zip(code.co_freevars, cells, strict=True))
    func = free.get("func")
    if func is None:
        return None
    value = func.cell_contents
    return value if callable(value) else None


def _settled_when_small(
    wrapper: Callable[..., Any],
    func: Callable[..., Any],
    small: contextvars.ContextVar[bool],
) -> Callable[..., Any]:
    """`wrapper`, except that a small request's call runs at once and returns a future
    already settled on the running loop (awaiting it does not yield)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if not small.get():
            return wrapper(*args, **kwargs)
        done = asyncio.get_running_loop().create_future()
        try:
            done.set_result(func(*args, **kwargs))
        except Exception as exc:  # handed to the awaiting caller, as the pool would
            done.set_exception(exc)
        return done

    return call


def _build_sync(options: FrontendOptions) -> Frontend:
    from starlette.datastructures import State
    from vllm import AsyncEngineArgs
    from vllm.config import VllmConfig
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.launchers.render.app_state import init_render_app_state
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="wasma serve"))
    try:
        args = parser.parse_args(options.vllm_args())
        validate_parsed_serve_args(args)
    except SystemExit:
        raise FrontendError(f"vLLM rejects the front-end flags {options.vllm_args()}") from None
    except (TypeError, ValueError) as exc:
        raise FrontendError(str(exc)) from None
    engine_args = AsyncEngineArgs.from_cli_args(args)
    try:
        model_config = engine_args.create_model_config()
    except Exception as exc:  # pydantic / HF errors: a directory that is not a model
        raise FrontendError(f"--model {options.model}: {str(exc).splitlines()[0]}") from None
    # As `vllm launch render` does: a render-only process computes nothing.
    model_config.quantization = None
    vllm_config = VllmConfig(
        model_config=model_config,
        logging_config=engine_args.create_logging_config(),
        structured_outputs_config=engine_args.create_structured_outputs_config(),
    )
    state = State()
    try:
        asyncio.run(init_render_app_state(vllm_config, state, args))
    except (KeyError, ValueError) as exc:  # an unknown parser name, a bad template
        raise FrontendError(str(exc).splitlines()[0]) from None
    return Frontend(state, options)
