"""`truncation: "auto"`: the oldest turns of a conversation dropped, in one measured cut, until the prompt fits.

A turn starts at a user message; system and developer messages are never dropped, and the newest turn never
(nothing would be left to answer). What a turn costs is measured once: each item's text is tokenized (linear in
the conversation) and the template's own tokens spread over the items, from the prompt the failed render
counted. The cut then drops as few of the oldest turns as cover the excess. Dropping one turn and rendering the
whole conversation again per turn would cost a render per dropped turn: 1,200 stored turns take 120 s so.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from deltafin.serving.responses.conversation import reasoning_text
from deltafin.serving.responses.items import Item, text_of

#: the template's tokens per item when the failed render's count is not known (a rule rewrote the error)
DEFAULT_OVERHEAD = 8


def is_kept(item: Item) -> bool:
    """System and developer messages survive any truncation."""
    return item["type"] == "message" and item.get("role") in ("system", "developer")


def turn_starts(items: Sequence[Item]) -> list[int]:
    """Where each turn begins: at each user message (the first turn also holds what comes before it)."""
    return [i for i, item in enumerate(items) if item["type"] == "message" and item.get("role") == "user"]


def without_turns(items: Sequence[Item], dropped: int) -> list[Item]:
    """`items` without their `dropped` oldest turns (system and developer messages stay)."""
    if dropped == 0:
        return list(items)
    starts = turn_starts(items)
    cut = starts[dropped] if dropped < len(starts) else len(items)
    return [item for i, item in enumerate(items) if i >= cut or is_kept(item)]


def item_text(item: Item) -> str:
    kind = item["type"]
    if kind == "message":
        return text_of(item["content"])
    if kind == "function_call":
        return f"{item.get('name', '')} {item.get('arguments', '')}"
    if kind == "function_call_output":
        output = item.get("output", "")
        return output if isinstance(output, str) else text_of(output)
    if kind == "reasoning":
        return reasoning_text(item)
    return json.dumps(item)


class TurnCosts:
    """Each item's tokens, counted once for a conversation; `cut` chooses how many of its oldest turns to drop."""

    def __init__(self, items: Sequence[Item], count_tokens: Callable[[str], int]) -> None:
        self.items = list(items)
        self.tokens = [count_tokens(item_text(item)) for item in self.items]
        self.starts = turn_starts(self.items)

    def cut(self, *, limit: int, completion: int, prompt_tokens: int | None, dropped: int = 0) -> int | None:
        """How many oldest turns to drop (more than `dropped`, the cut that was just rendered) so that the prompt
        leaves room for `completion` tokens (at least one) in a context of `limit`; the rendered prompt held
        `prompt_tokens` (None: not known, estimated from the items). None when only the newest turn would be
        left."""
        kept = self._kept(dropped)
        text = sum(self.tokens[i] for i in kept)
        if prompt_tokens is None:
            overhead, prompt_tokens = DEFAULT_OVERHEAD, text + DEFAULT_OVERHEAD * len(kept)
        else:
            overhead = max(0, (prompt_tokens - text) // max(1, len(kept)))
        excess = prompt_tokens + max(completion, 1) - limit
        freed, turns = 0, dropped
        while turns < len(self.starts) - 1:
            begin = self.starts[turns] if turns else 0
            freed += sum(
                self.tokens[i] + overhead for i in range(begin, self.starts[turns + 1]) if not is_kept(self.items[i])
            )
            turns += 1
            if freed >= excess:
                break
        return turns if turns > dropped else None

    def _kept(self, dropped: int) -> list[int]:
        cut = 0 if dropped == 0 else self.starts[dropped] if dropped < len(self.starts) else len(self.items)
        return [i for i, item in enumerate(self.items) if i >= cut or is_kept(item)]
