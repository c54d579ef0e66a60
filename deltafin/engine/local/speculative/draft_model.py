"""Drafts from a second, smaller model with the same tokenizer (`engine.speculative.draft_path`).

The draft model runs on the same kinds of step as the main one (a GGUF in its own blocks through the native C
step, float weights through the fused or transformers step) and keeps a batch cache of its own, one row per
main row, holding a prefix of that row's tokens. Each step, for the rows that may draft:
1. rows new to it get their tokens prefilled; the others drop what the main model rejected since (their cache
   is cut back to the longest prefix it shares with the row's tokens: `BatchKV.truncate`);
2. one pass feeds each row the tokens it has not seen (its pending token, and the tokens the main model
   accepted from its last draft), and each later pass the token the previous one guessed: the draft's greedy
   choice. Its guesses are a point-mass proposal, which the main model's own sampling checks exactly
   (deltafin.engine.local.speculative.speculation).
Rows that leave the main batch leave this one at the next step.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from deltafin.engine.kv.batch import BatchKV
from deltafin.engine.local.generator import cache_argument, prefill
from deltafin.engine.local.speculative.forward import many_token_forward
from deltafin.engine.local.steps import decode_step_for
from deltafin.engine.weights.loader import LoadedModel, ModelLoadError


def check_tokenizers(draft: Any, main: Any) -> str | None:
    """Why the draft's tokens cannot stand for the main model's (None: they can): the same vocabulary."""
    if draft.get_vocab() != main.get_vocab():
        return "its tokenizer's vocabulary differs from the model's (a draft must use the same tokenizer)"
    return None


def weight_bytes(model: Any) -> int:
    """The bytes of a model's parameters and buffers (GGUF blocks included): what a pass reads."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


class DraftModelDrafter:
    def __init__(self, draft: LoadedModel, *, main: LoadedModel) -> None:
        problem = check_tokenizers(draft.tokenizer, main.tokenizer)
        if problem is not None:
            raise ModelLoadError(f"engine.speculative.draft_path: {problem}")
        self.model = draft.model
        self.device = next(self.model.parameters()).device
        self.cache_arg = cache_argument(self.model)
        self.forward = many_token_forward(
            self.model, decode_step_for(self.model), cache_arg=self.cache_arg, device=self.device
        )
        # A guess costs one pass of the draft model; on a memory-bound step, its share of the main one's bytes.
        self.cost_per_token = weight_bytes(self.model) / max(1, weight_bytes(main.model))
        self._kv = BatchKV(self.device)
        self._rows: list[Any] = []  # the main rows, in this batch's order
        #: per main row: the tokens this batch's row holds, and how many of them are known to be the row's own
        self._held: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()
        self._confirmed: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    def propose(self, rows: Sequence[Any], limits: Sequence[int]) -> list[list[int]]:
        try:
            return self._propose(rows, limits)
        except Exception:  # the engine fails the batch: this one starts over too
            self._kv, self._rows = BatchKV(self.device), []
            self._held.clear()
            self._confirmed.clear()
            raise

    def _propose(self, rows: Sequence[Any], limits: Sequence[int]) -> list[list[int]]:
        self._sync(rows)
        wanted = {id(row): limit for row, limit in zip(rows, limits) if limit > 0}
        drafts: dict[int, list[int]] = {id(row): [] for row in rows}
        if not wanted:
            return [[] for _ in rows]
        with torch.inference_mode():
            self._join([row for row in rows if id(row) in wanted and row not in self._held])
            feed: list[list[int]] = []
            for i, row in enumerate(self._rows):
                if id(row) not in wanted:
                    feed.append([])
                    continue
                held = self._held[row]
                # What it holds beyond the row's tokens are guesses; the first the main model did not keep ends it.
                shared = _common_prefix(held, row.ids, self._confirmed[row])
                if shared < len(held):
                    self._kv.truncate(i, shared)
                    del held[shared:]
                feed.append([*row.ids[shared:], row.pending])  # at least the pending token: a guess after it
                self._confirmed[row] = len(row.ids) + 1
            while any(feed):
                guesses = self._pass(feed)
                feed = []
                for i, row in enumerate(self._rows):
                    guess = guesses[i]
                    if guess is None:
                        feed.append([])
                        continue
                    draft = drafts[id(row)]
                    draft.append(guess)
                    feed.append([guess] if len(draft) < wanted[id(row)] else [])
        return [drafts[id(row)] for row in rows]

    def _pass(self, feed: list[list[int]]) -> list[int | None]:
        """One pass of the draft model over each row's `feed`; its greedy guess after the last fed token."""
        placement = self._kv.place([len(f) for f in feed], own_columns=self.forward.own_columns)
        logits = self.forward.run(self._kv, feed, placement)
        self._kv.accept(placement, [len(f) for f in feed])
        for row, tokens in zip(self._rows, feed):
            self._held[row].extend(tokens)
        last = [i for i, f in enumerate(feed) if f]
        picked = torch.stack([logits[i][-1] for i in last]).argmax(dim=-1).tolist()
        guesses: list[int | None] = [None] * len(feed)
        for i, token in zip(last, picked):
            guesses[i] = token
        return guesses

    def _sync(self, rows: Sequence[Any]) -> None:
        """Rows that left the main batch leave this one."""
        present = {id(row) for row in rows}
        keep = [i for i, row in enumerate(self._rows) if id(row) in present]
        if len(keep) != len(self._rows):
            self._kv.keep(keep)
            self._rows = [self._rows[i] for i in keep]

    def _join(self, rows: list[Any]) -> None:
        """New rows: every token they fed so far prefilled into a cache of their own, then into the batch."""
        for row in rows:
            cache = DynamicCache(config=self.model.config)
            prefill(self.model, row.ids, cache, 0, cache_arg=self.cache_arg)
            self._kv.add(cache, len(row.ids))
            self._rows.append(row)
            self._held[row] = list(row.ids)
            self._confirmed[row] = len(row.ids)


def _common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """The length of a and b's common prefix, knowing that their first `start` items agree."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i
