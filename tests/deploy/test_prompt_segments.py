"""Prompt token ids a segment at a time: the same ids as the tokenizer's, exactly."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wasma.deploy.prompt_segments import SegmentTokens

pytest.importorskip("transformers")

MARKS = ("<|im_start|>", "<|im_end|>", "<|tool|>")
WORDS = ("the", " planner", "reads", " plan", "\n", "  ", "worker", "é", "12", "{", "}", ":")


def _fast_tokenizer(pre: str, extra: tuple[Any, ...] = ()) -> Any:
    """A small BPE fast tokenizer: byte-level (GPT-2, Llama 3, Qwen) or SentencePiece-style
    Metaspace that prepends only to the text's first piece (Llama 2's `first`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if pre == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
        alphabet = []
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>"],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    corpus = ["the planner reads the plan; the worker writes é 12 {a: b}"] * 50
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKS])
    if extra:
        tok.add_special_tokens(list(extra))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.fixture(scope="module")
def bytelevel() -> Any:
    return _fast_tokenizer("bytelevel")


texts = st.lists(st.sampled_from(WORDS + MARKS), max_size=40).map("".join)


@settings(max_examples=150, deadline=None)
@given(conversation=st.lists(texts, min_size=1, max_size=6))
def test_ids_equal_the_tokenizers_on_random_texts(bytelevel: Any, conversation: list[str]) -> None:
    """Random texts of words and special tokens, each a turn longer than the last (as a
    conversation's prompts are): the cached ids are the tokenizer's, first time and
    again."""
    cache = SegmentTokens.for_tokenizer(bytelevel)
    assert cache is not None
    assert cache.boundaries == frozenset(MARKS) | {"<unk>"}
    prompt = ""
    for turn in conversation:
        prompt += turn
        whole = bytelevel(prompt, add_special_tokens=False)["input_ids"]
        assert cache.encode(prompt) == whole
        assert cache.encode(prompt) == whole


def test_a_grown_prompt_tokenizes_only_its_new_segments(bytelevel: Any) -> None:
    cache = SegmentTokens.for_tokenizer(bytelevel)
    assert cache is not None
    first = "<|im_start|>system\nplan<|im_end|>\n<|im_start|>user\nreads<|im_end|>\n"
    cache.encode(first)
    misses = cache.misses
    grown = first + "<|im_start|>assistant\nthe plan<|im_end|>\n"
    assert cache.encode(grown) == bytelevel(grown, add_special_tokens=False)["input_ids"]
    # Cut after each mark: "\n<|im_start|>" and the tail "\n" were seen in the first
    # prompt; only "assistant\nthe plan<|im_end|>" is new.
    assert cache.misses - misses == 1


def test_position_dependent_pre_tokenizer_is_refused() -> None:
    """SentencePiece's "prepend to the first piece only" would prepend to every segment
    cut alone: the self-test finds it and the renderer keeps tokenizing whole texts."""
    tok = _fast_tokenizer("metaspace")
    text = "a<|im_end|>the plan"
    cache = SegmentTokens(tok, MARKS, MARKS)
    assert cache.encode(text) != tok(text, add_special_tokens=False)["input_ids"]
    assert SegmentTokens.for_tokenizer(tok) is None


def test_tokens_that_strip_or_nest_are_never_cut_after() -> None:
    from tokenizers import AddedToken

    tok = _fast_tokenizer(
        "bytelevel",
        (
            AddedToken("<|strip|>", special=True, normalized=False, rstrip=True),
            AddedToken("<|im_end|>\n", special=True, normalized=False),
        ),
    )
    cache = SegmentTokens.for_tokenizer(tok)
    assert cache is not None
    assert "<|strip|>" not in cache.boundaries  # it takes the spaces after it
    assert "<|im_end|>" not in cache.boundaries  # a longer token begins with it
    for text in ("a<|strip|>   b<|im_end|>\nc", "x<|im_end|>y<|im_start|> z<|strip|>"):
        assert cache.encode(text) == tok(text, add_special_tokens=False)["input_ids"]
    word = _fast_tokenizer(
        "bytelevel", (AddedToken("plan", special=True, normalized=False, single_word=True),)
    )
    assert SegmentTokens.for_tokenizer(word) is None


def test_a_small_capacity_evicts_and_stays_exact(bytelevel: Any) -> None:
    cache = SegmentTokens.for_tokenizer(bytelevel, capacity_tokens=12)
    assert cache is not None
    for i in range(30):
        text = f"<|im_start|>the plan {i}<|im_end|>reads {i % 3}<|im_end|>"
        assert cache.encode(text) == bytelevel(text, add_special_tokens=False)["input_ids"]
        assert cache._tokens <= 12


def test_vllm_renders_a_growing_conversation_to_the_same_ids(sim_frontend: Any) -> None:
    """Through vLLM's renderer (chat template, tools, the gateway's own render call):
    every turn's ids equal the tokenizer's for the text vLLM rendered (what vLLM's own
    tokenize step computes), and later turns reuse what earlier ones tokenized."""
    from wasma.deploy.api import render

    fe = sim_frontend
    cache = fe.segments
    assert cache is not None
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
    ]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "you plan <|user|> é"}]
    seen: list[str] = []
    encode = cache.encode

    def recording(text: str) -> list[int]:
        seen.append(text)
        return encode(text)

    async def turns() -> None:
        for i in range(6):
            messages.append({"role": "user", "content": f"step {i}: the planner reads\n"})
            body = {"model": "wasma-sim", "messages": list(messages), "tools": tools}
            misses = cache.misses
            rendered = await render(fe, "chat", body)
            whole = fe.tokenizer(seen[-1], add_special_tokens=False)["input_ids"]
            assert rendered.token_ids == whole
            if i:
                assert cache.misses - misses <= 3  # the new turn, not the conversation
            messages.append({"role": "assistant", "content": f"plan {i}"})

    cache.encode = recording  # type: ignore[method-assign]
    try:
        asyncio.run(turns())
    finally:
        del cache.encode
    assert len(seen) == 6


def test_segments_tokenize_with_a_copy_of_the_rust_tokenizer(bytelevel: Any) -> None:
    """New segments go to the Rust tokenizer itself (no Python wrapper a call), a copy of
    its own: truncation set on the shared one (as a caller that truncates leaves it)
    does not cut the segments' ids."""
    cache = SegmentTokens.for_tokenizer(bytelevel)
    assert cache is not None and cache._direct is not None
    text = "<|im_start|>the planner reads the plan<|im_end|>" * 20
    expected = bytelevel(text, add_special_tokens=False)["input_ids"]
    bytelevel.backend_tokenizer.enable_truncation(max_length=4)
    try:
        assert cache.encode(text) == expected and len(expected) > 4
    finally:
        bytelevel.backend_tokenizer.no_truncation()


def test_a_tokenizer_without_a_serializable_backend_keeps_its_wrapper(bytelevel: Any) -> None:
    class Wrapped:
        """The same tokenizer behind a wrapper that hides its Rust backend's methods."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.backend_tokenizer = type(
                "Backend",
                (),
                {"get_added_tokens_decoder": inner.backend_tokenizer.get_added_tokens_decoder},
            )()

        def __call__(self, text: str, **kwargs: Any) -> Any:
            return self.inner(text, **kwargs)

    cache = SegmentTokens.for_tokenizer(Wrapped(bytelevel))
    assert cache is not None and cache._direct is None
    text = "<|im_start|>the plan<|im_end|>reads"
    assert cache.encode(text) == bytelevel(text, add_special_tokens=False)["input_ids"]
