"""Message text to token ids with no control token among them, whatever the text holds.

`split_special_tokens` keeps a fast tokenizer from matching *special* added tokens in text, but it still
matches the non-special ones, and some checkpoints' control tokens are not special (Kimi K3's `<|open|>`,
Qwen3's `<tool_call>`). So text holding one of the format's control strings that the tokenizer would still
match is tokenized without the added vocabulary at all (normalizer, pre-tokenizer and model, as the backend
does between added tokens). Kimi's own tiktoken tokenizers (remote code) recognise every `<|...|>` in
`tokenize`; they are asked for plain text with their own switch, as K3's reference encoder asks them.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any

from deltafin.token_codec import TokenCodec


def _own_plain_encoder(tokenizer: Any) -> Callable[[str], list[int]] | None:
    """Kimi's tiktoken tokenizers: `encode(text, allow_special_tokens=False)` is their plain-text encoding."""
    try:
        parameters = inspect.signature(type(tokenizer).encode).parameters
    except (TypeError, ValueError):
        return None
    if "allow_special_tokens" not in parameters:
        return None
    return lambda text: list(tokenizer.encode(text, allow_special_tokens=False))


class PlainText:
    """`encode(text)`: text as plain text; `controls` are the strings a format uses as control tokens."""

    def __init__(self, tokenizer: Any, controls: Iterable[str] = ()) -> None:
        self._codec = TokenCodec(tokenizer)
        self._own = _own_plain_encoder(tokenizer)
        wanted = set(controls)
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        matched_anyway = sorted(
            {t.content for t in added.values() if not t.special and t.content in wanted}, key=len, reverse=True
        )
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        self._matched_anyway = (
            re.compile("|".join(map(re.escape, matched_anyway)))
            if matched_anyway and self._backend is not None
            else None
        )

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self._own is not None:
            return self._own(text)
        if self._matched_anyway is not None and self._matched_anyway.search(text):
            return self._without_added_vocabulary(text)
        return self._codec.encode(text, split_special_tokens=True)

    def _without_added_vocabulary(self, text: str) -> list[int]:
        backend = self._backend  # set: _matched_anyway is only built with a backend
        assert backend is not None
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        pieces = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
        return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]
