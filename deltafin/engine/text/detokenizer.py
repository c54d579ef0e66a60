"""Incremental detokenization: text for each new token, holding back incomplete UTF-8 sequences.

A fast tokenizer whose decode is its Rust backend's (deltafin.token_codec) streams through tokenizers' own
`DecodeStream`, which does the same work in Rust: 1.6 us a token against 2.5 for the Python window below
(bench/handwritten.py, docs/benchmarks.md). Any other tokenizer (slow, remote code, spaces cleaned up) decodes
a window of ids through transformers."""

from __future__ import annotations

from typing import Any

from deltafin.token_codec import decoder_for, direct_backend


class IncrementalDetokenizer:
    """Decodes a growing token list a window at a time, so each step costs O(1) tokens, not O(n)."""

    def __init__(self, tokenizer: Any) -> None:
        self._backend = direct_backend(tokenizer)
        self._stream: Any = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=False)
        self._decode = decoder_for(tokenizer)
        self._ids: list[int] = []
        # Text of ids[prefix:read] was already emitted; decoding from `prefix` keeps tokenizers that
        # drop or merge leading spaces consistent with a decode of the whole sequence.
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""  # None: an incomplete character, held back
        self._ids.append(token_id)
        decode = self._decode
        before = decode(self._ids[self._prefix : self._read])
        after = decode(self._ids[self._prefix :])
        # U+FFFD at the end means the token split a multi-byte character: wait for the rest.
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""
