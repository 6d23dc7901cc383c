"""A prompt's token ids a segment at a time: what a conversation's turns share is
tokenized once.

A multi-agent prompt is mostly an earlier prompt plus new messages, and vLLM's renderer
tokenizes the whole rendered text every time (about 1 us a token on these machines: 2 ms
for a 2k-token conversation, most of a render). A fast (Rust) tokenizer first cuts the text
at its added tokens that are matched on the raw text, and normalizes, pre-tokenizes and
encodes the pieces between them independently; so the ids of a text are the ids of its
pieces end to end, wherever the cuts are made at such tokens. `SegmentTokens` cuts a prompt
after each special token (`<|im_end|>`, `<|eot_id|>`, a template's role markers), looks
each segment up, tokenizes only the segments it has not seen (one batch call to the same
tokenizer) and concatenates.

Exact, not approximate: a tokenizer is taken only where the cut is provably neutral (no
`single_word` tokens; cuts only after special tokens that strip nothing and that no other
added token contains) and where a self-test of probe texts gives the same ids both ways,
which rules out position-dependent pre-tokenizers (SentencePiece's "prepend only to the
first piece", which would prepend to every segment). Anything else, and every call the
renderer makes with options the segments do not model (special tokens added, offsets,
truncation that would cut), goes to the tokenizer as before.
"""

from __future__ import annotations

import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)

# Segments kept, in token ids (4 bytes each, plus the segment's text as its key).
DEFAULT_CAPACITY_TOKENS = 4_000_000


class SegmentTokens:
    """Token ids of texts, cut after `boundaries`, with an LRU of segments' ids."""

    def __init__(
        self,
        tokenizer: Any,
        scanned: Iterable[str],
        boundaries: Iterable[str],
        capacity_tokens: int = DEFAULT_CAPACITY_TOKENS,
    ) -> None:
        self.tokenizer = tokenizer
        self.boundaries = frozenset(boundaries)
        # The tokenizer's first cut matches leftmost-longest over these strings: the
        # same alternation, longest first, finds the same matches.
        ordered = sorted(set(scanned) | self.boundaries, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(s) for s in ordered))
        self.capacity_tokens = capacity_tokens
        self._segments: OrderedDict[str, array[int]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()  # vLLM tokenizes on a pool of threads too
        self.enabled = True  # off: every prompt goes to vLLM's own tokenize step
        self.hits = 0  # segments found
        self.misses = 0  # segments tokenized
        # The Rust tokenizer itself, where it gives the wrapper's ids (`_direct`).
        self._direct: Callable[[str], list[int]] | None = None

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, capacity_tokens: int = DEFAULT_CAPACITY_TOKENS
    ) -> SegmentTokens | None:
        """A cache for `tokenizer`, or None where cutting could change its ids."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        added = getattr(backend, "get_added_tokens_decoder", None)
        if added is None:
            return None  # not a fast tokenizer: no proof of how it cuts
        tokens = list(added().values())
        if any(t.single_word for t in tokens):
            return None  # a word-boundary rule looks across the cut
        raw = [t.content for t in tokens if not t.normalized and t.content]
        boundaries = [
            t.content
            for t in tokens
            if t.special
            and not t.lstrip
            and not t.rstrip
            and not t.normalized
            and t.content
            and not any(t.content in other and t.content != other for other in raw)
        ]
        if not boundaries:
            return None
        cache = cls(tokenizer, raw, boundaries, capacity_tokens)
        if not cache.self_test():
            log.info("prompt segments off: this tokenizer's ids depend on where a piece starts")
            return None
        cache._direct = _direct_encoder(tokenizer, cache.probes())
        return cache

    def whole(self, text: str) -> list[int]:
        """The tokenizer's own ids for `text` (no special tokens added)."""
        if self._direct is not None:
            return self._direct(text)
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    def probes(self) -> list[str]:
        """Texts that put each boundary token (the first 16) beside the characters a
        pre-tokenizer treats differently at a piece's start."""
        tails = (" x", "x", "X1", "\n\nx", "  2", "\u00e9t\u00e9", "", "<", "\u2581x", "\t}")
        marks = sorted(self.boundaries)[:16]
        return [
            f"a{mark}{tail}{other}{tail} z"
            for mark in marks
            for tail in tails
            for other in (mark, marks[-1], "")
        ]

    def self_test(self) -> bool:
        """Probe texts give the same ids cut and whole (and the probes' segments are
        forgotten after)."""
        try:
            same = all(self.encode(p) == self.whole(p) for p in self.probes())
        finally:
            self.clear()
        return same

    def clear(self) -> None:
        with self._lock:
            self._segments.clear()
            self._tokens = 0
            self.hits = self.misses = 0

    def split(self, text: str) -> list[str]:
        """`text` cut after each boundary token (the pieces end to end are `text`)."""
        cuts = [m.end() for m in self._pattern.finditer(text) if m.group() in self.boundaries]
        if not cuts:
            return [text]
        pieces = []
        start = 0
        for end in cuts:
            pieces.append(text[start:end])
            start = end
        if start < len(text):
            pieces.append(text[start:])
        return pieces

    def encode(self, text: str) -> list[int]:
        """The tokenizer's ids for `text` without special tokens added, exactly."""
        pieces = self.split(text)
        found: dict[str, array[int]] = {}
        with self._lock:
            for piece in pieces:
                ids = self._segments.get(piece)
                if ids is not None:
                    self._segments.move_to_end(piece)
                    found[piece] = ids
            missing = [p for p in dict.fromkeys(pieces) if p not in found]
            self.hits += len(pieces) - len(missing)
            self.misses += len(missing)
        if missing:
            # One call a segment: a batch call would hand so few texts to the
            # tokenizer's thread pool, which costs more than it saves.
            fresh = {p: array("i", self.whole(p)) for p in missing}
            found.update(fresh)
            self._store(fresh)
        out: list[int] = []
        for piece in pieces:
            out.extend(found[piece])
        return out

    def _store(self, fresh: dict[str, array[int]]) -> None:
        with self._lock:
            for piece, ids in fresh.items():
                if len(ids) > self.capacity_tokens or piece in self._segments:
                    continue
                self._segments[piece] = ids
                self._tokens += len(ids)
            while self._tokens > self.capacity_tokens and self._segments:
                _, old = self._segments.popitem(last=False)
                self._tokens -= len(old)


def _direct_encoder(tokenizer: Any, probes: list[str]) -> Callable[[str], list[int]] | None:
    """The ids of a text from the Rust tokenizer behind `tokenizer`, without the Python
    wrapper's per-call work (its keyword handling, truncation and padding set-up, the
    conversion of its encodings to a dict of lists: 90 of 145 us for a one-line text here,
    about a quarter of a 2.6k-token one). A copy of its own, so that no truncation or
    padding another caller sets on the shared one applies to it; None unless it gives
    the wrapper's ids on the probes."""
    backend: Any = getattr(tokenizer, "backend_tokenizer", None)
    to_str = getattr(backend, "to_str", None)
    if to_str is None:
        return None
    try:
        from tokenizers import Tokenizer

        own = Tokenizer.from_str(to_str())
        own.no_truncation()
        own.no_padding()
        own.encode_special_tokens = backend.encode_special_tokens
    except Exception:  # another tokenizers release, a backend that does not serialize
        return None

    def encode(text: str) -> list[int]:
        ids: list[int] = own.encode(text, add_special_tokens=False).ids
        return ids

    texts = [*probes, "", " ", "the plan\n\n", "\u00e9t\u00e9 \U0001f600 12345 {a: b}"]
    if all(encode(t) == tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts):
        return encode
    log.info("prompt segments tokenize through the tokenizer's wrapper: its ids differ")
    return None


def install(renderer: Any, capacity_tokens: int = DEFAULT_CAPACITY_TOKENS) -> SegmentTokens | None:
    """Tokenize the prompts of vLLM's `renderer` (vLLM 0.32's `BaseRenderer`) through a
    `SegmentTokens`; None, and the renderer as it was, where the tokenizer does not allow
    it or the renderer is not the one this was written against."""
    original = getattr(renderer, "_tokenize_prompt", None)
    build = getattr(renderer, "_build_tokens_prompt", None)
    wants_offsets = getattr(renderer, "_wants_offsets", None)
    executor = getattr(renderer, "_executor", None)
    if original is None or build is None or wants_offsets is None or executor is None:
        return None
    try:
        tokenizer = renderer.get_tokenizer()
    except Exception:  # a renderer built without a tokenizer
        return None
    cache = SegmentTokens.for_tokenizer(tokenizer, capacity_tokens)
    if cache is None:
        return None
    from vllm.utils.async_utils import make_async

    def tokenize_prompt(prompt: Any, params: Any) -> Any:
        text = prompt.get("prompt")
        kwargs = params.get_encode_kwargs()
        if (
            not cache.enabled
            or not isinstance(text, str)
            or kwargs.get("add_special_tokens")
            or wants_offsets(prompt, params)
        ):
            return original(prompt, params)
        ids = cache.encode(text)
        limit = kwargs.get("max_length") if kwargs.get("truncation") else None
        if limit is not None and len(ids) > limit:
            return original(prompt, params)  # the tokenizer's own truncation
        return build(ids, prompt)

    renderer._tokenize_prompt = tokenize_prompt
    # vLLM's async wrapper of the same function, on the same pool, as its __init__ makes.
    renderer._tokenize_prompt_async = make_async(tokenize_prompt, executor=executor)
    return cache
