"""Incremental detokenization: text for each new token, holding back incomplete UTF-8 sequences."""

from __future__ import annotations

from typing import Any

from deltafin.token_codec import decoder_for


class IncrementalDetokenizer:
    """Decodes a growing token list a window at a time, so each step costs O(1) tokens, not O(n)."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = decoder_for(tokenizer)
        self._ids: list[int] = []
        # Text of ids[prefix:read] was already emitted; decoding from `prefix` keeps tokenizers that
        # drop or merge leading spaces consistent with a decode of the whole sequence.
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self._decode
        before = decode(self._ids[self._prefix : self._read])
        after = decode(self._ids[self._prefix :])
        # U+FFFD at the end means the token split a multi-byte character: wait for the rest.
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""
