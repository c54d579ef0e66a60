"""Test doubles shared by the engine tests."""

from __future__ import annotations

import structlog


class AllowList:
    """A fake grammar: only `allowed` token ids, complete after `length` tokens."""

    def __init__(self, allowed, length):
        self.allowed, self.length, self.accepted = list(allowed), length, []
        self.contexts = []

    def fill_mask(self, logits):
        self.contexts.append(structlog.contextvars.get_contextvars().get("request_id"))
        keep = logits[self.allowed].clone()
        logits.fill_(float("-inf"))
        logits[self.allowed] = keep

    def accept(self, token_id):
        self.accepted.append(token_id)

    def is_terminated(self):
        return len(self.accepted) >= self.length


class AllowListGrammar:
    """A fake ready grammar (deltafin.engine.local.matcher.MatcherSource): an AllowList per row, each kept in `rows`."""

    def __init__(self, allowed, length):
        self.allowed, self.length = list(allowed), length
        self.rows: list[AllowList] = []

    def matcher(self) -> AllowList:
        self.rows.append(AllowList(self.allowed, self.length))
        return self.rows[-1]
