"""Encode and decode through a fast tokenizer's Rust backend when that gives exactly what transformers would.

transformers wraps each call in ~20 us (encode) and ~2 us (decode) of Python: argument handling, BatchEncoding,
`to_py_obj`. A chat render encodes every piece of template and message text separately and a stream decodes
twice per token, so in front of an upstream that wrapper cost more CPU than the tokenizing itself. The backend
is called directly only where transformers' own call reduces to the same backend call: a `TokenizersBackend`
whose encode and decode are not overridden, with no cleanup of decoded spaces and no truncation or padding set
on the backend. Anything else (a slow or remote-code tokenizer) goes through transformers.

Template text (a system prompt, role headers, tool definitions) comes back request after request, so its ids
are kept in a small cache; message text, which rarely repeats, is not.

Encoding flips the backend's `encode_special_tokens` flag, so a codec is used by one thread only, like the
tokenizer it wraps.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def direct_backend(tokenizer: Any) -> Any | None:
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # pragma: no cover - another transformers layout: no shortcut
        return None
    kind = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(tokenizer, TokenizersBackend) or backend is None:
        return None
    same_calls = (
        kind.__call__ is PreTrainedTokenizerBase.__call__
        and kind._encode_plus is TokenizersBackend._encode_plus
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is TokenizersBackend._decode
    )
    if not same_calls or tokenizer.clean_up_tokenization_spaces:
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    return backend


#: Texts longer than this go through `encode_batch`, which lets go of the GIL while it works (`encode` holds it:
#: a megabyte of prompt on a prompt thread would stop the event loop for seconds); shorter ones through `encode`,
#: which costs a few microseconds where `encode_batch` costs ~60 (its thread pool).
_GIL_FREE_CHARS = 4096
#: Template pieces longer than this are encoded every time, and the cache is emptied when it holds this many.
_CACHED_PIECE_CHARS = 16 * 1024
_CACHED_PIECES = 256


class TokenCodec:
    """`encode(text, split_special_tokens=...)` without special tokens added, and `decode(ids)` with special
    tokens kept: the two calls the prompt and the detokenizer make per piece and per token."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = direct_backend(tokenizer)
        self._template_ids: dict[str, tuple[int, ...]] = {}

    @property
    def direct(self) -> bool:
        """Whether calls skip transformers (for tests and logs)."""
        return self._backend is not None

    def encode(self, text: str, *, split_special_tokens: bool) -> list[int]:
        if not text:
            return []
        backend = self._backend
        if backend is None:
            return list(
                self.tokenizer(text, add_special_tokens=False, split_special_tokens=split_special_tokens).input_ids
            )
        if backend.encode_special_tokens != split_special_tokens:
            backend.encode_special_tokens = split_special_tokens
        if len(text) > _GIL_FREE_CHARS:
            return backend.encode_batch([text], add_special_tokens=False)[0].ids
        return backend.encode(text, add_special_tokens=False).ids

    def encode_template(self, text: str) -> tuple[int, ...]:
        """Template text, control tokens live (`split_special_tokens=False`); repeated pieces from the cache."""
        ids = self._template_ids.get(text)
        if ids is None:
            ids = tuple(self.encode(text, split_special_tokens=False))
            if len(text) <= _CACHED_PIECE_CHARS:
                if len(self._template_ids) >= _CACHED_PIECES:
                    self._template_ids.clear()  # simple bound; the live pieces refill it at once
                self._template_ids[text] = ids
        return ids

    def decode(self, ids: list[int]) -> str:
        if self._backend is None:
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        return self._backend.decode(ids, skip_special_tokens=False)


#: tokenizer -> its codec's `decode`: deciding whether the backend may be called directly inspects the
#: tokenizer and its class, and every generated choice makes a detokenizer (that inspection was ~3% of a
#: gateway request's CPU). Decoding changes no state, so the threads share one.
_decoders: weakref.WeakKeyDictionary[Any, Callable[[list[int]], str]] = weakref.WeakKeyDictionary()


def decoder_for(tokenizer: Any) -> Callable[[list[int]], str]:
    """`TokenCodec(tokenizer).decode`, made once per tokenizer (when it decodes through the backend)."""
    try:
        cached = _decoders.get(tokenizer)
    except TypeError:  # a tokenizer that cannot be weakly referenced
        return TokenCodec(tokenizer).decode
    if cached is not None:
        return cached
    codec = TokenCodec(tokenizer)
    backend = codec._backend
    if backend is None:
        return codec.decode  # it holds the tokenizer, so kept it would keep its own key alive

    def decode(ids: list[int]) -> str:
        return backend.decode(ids, skip_special_tokens=False)

    _decoders[tokenizer] = decode
    return decode
