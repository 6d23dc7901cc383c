"""Text <-> token ids for the gateway: the model's own tokenizer, or a byte-level one.

The router hashes token ids, so text requests are tokenised once, in the gateway, and
engines only ever see ids. Real engines need the model's tokenizer (and its chat
template); simulated engines have no model, so a deterministic byte-level tokenizer
stands in (its output text is noise, like the simulator's tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

# Ids below this are left to special tokens, as the simulator's materialiser does.
BYTE_OFFSET = 16


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat(self, messages: list[dict[str, str]]) -> list[int]: ...


def _plain_template(messages: list[dict[str, str]]) -> str:
    """A chat rendering for models without a template: role-tagged lines, then the
    assistant's turn."""
    lines = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(lines) + "<|assistant|>\n"


class ByteTokenizer:
    """UTF-8 bytes shifted past the special ids; other ids decode to printable noise."""

    def __init__(self, vocab_size: int = 128_256) -> None:
        if vocab_size <= BYTE_OFFSET + 256:
            raise ValueError(f"vocab_size must exceed {BYTE_OFFSET + 256}, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        out = bytearray()
        for t in ids:
            if BYTE_OFFSET <= t < BYTE_OFFSET + 256:
                out.append(t - BYTE_OFFSET)
            else:
                # Simulated output ids span the whole vocabulary: show them as letters.
                out.append(97 + t % 26)
        return out.decode("utf-8", errors="replace")

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(_plain_template(messages))


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a model directory."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self._tok: Any = AutoTokenizer.from_pretrained(model_dir)
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        if getattr(self._tok, "chat_template", None):
            ids = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            # transformers >= 5 may return a BatchEncoding rather than a list.
            if not isinstance(ids, list):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        return list(self._tok.encode(_plain_template(messages), add_special_tokens=True))
