"""One choice's reasoning against its thinking budget, token by token: how many reasoning tokens it wrote, and
when the family's end of reasoning must be forced.

Every engine runs the same count (`ReasoningTracker`): the local engine forces the end tokens itself, at the
budget (`next_forced`); an upstream engine's choice is watched (`overruns`), and a generation that would put a
reasoning token past the budget is stopped there and resumed with the end forced
(deltafin.engine.upstream.engine). Where an upstream has a budget of its own it forces the same end at the
same count, and the watch never fires.

The end of reasoning is found in the text, as the family's parser finds it, so a model that spells `</think>`
in pieces ends its reasoning for the budget as for the parser. States:
- idle: the prompt left it to the model to open reasoning (`start`); output that starts otherwise has none;
- counting: inside reasoning; each token counts until an end shows (its tokens do not count);
- forcing: the budget is spent; the forced ids come next;
- done: reasoning is over (or never began). A second reasoning block is not budgeted: the parser reads only the
  first as reasoning.
A generation cut by max_tokens inside reasoning keeps the tokens it wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deltafin.protocol.sampling import ReasoningBudget, SamplingParams
from deltafin.token_codec import decoder_for

IDLE, COUNTING, FORCING, DONE = "idle", "counting", "forcing", "done"
#: text kept to find an end marker that a token completes (the longest marker, plus one token's text)
_WINDOW = 256


class ReasoningTracker:
    """`piece(token_id)`: the token's text (one token decoded alone; control tokens included)."""

    def __init__(self, budget: ReasoningBudget, piece: Callable[[int], str]) -> None:
        self.budget = budget
        self._piece = piece
        self.state = COUNTING if budget.opened is not None else IDLE if budget.start else DONE
        #: reasoning tokens so far
        self.tokens = 0
        self._text = ""  # the latest reasoning text (counting), or the output so far (idle)
        self._lengths: list[int] = []  # the text length of each counted token still inside `_text`
        self._recent: list[int] = []  # the latest counted ids, as long as `forced` (a forced end already begun)
        self._at = 0  # the next forced id's index
        self._forced_text = ""

    @property
    def over(self) -> bool:
        """The budgeted reasoning is behind this choice: nothing will be forced any more."""
        return self.state == DONE

    def next_forced(self) -> int | None:
        """The id this choice must take next (the forced end of reasoning), or None: it samples freely."""
        if self.state == COUNTING and self.tokens >= self.budget.tokens:
            self._start_forcing()
        return self.budget.forced[self._at] if self.state == FORCING else None

    def overruns(self, token_id: int) -> bool:
        """Whether `token_id` (sampled by someone else: an upstream) would break the budget: a reasoning token past
        it, where the forced end must stand. A token that keeps within it is for `observe` next."""
        forced = self.next_forced()
        if forced is None or token_id == forced:
            return False
        if any(end in self._forced_text for end in self.budget.ends):
            self.state = DONE  # the end itself is written; what the model writes after it is its own
            return False
        return True

    def remaining_forced(self) -> tuple[int, ...]:
        """The forced ids still to come (after `overruns` said so, what a resumed generation starts with)."""
        return self.budget.forced[self._at :] if self.state == FORCING else ()

    def observe(self, token_id: int) -> None:
        """The choice wrote `token_id`."""
        if self.state == COUNTING:
            self._count(token_id)
        elif self.state == FORCING:
            self._forced(token_id)
        elif self.state == IDLE:
            self._idle(token_id)

    # -- states ------------------------------------------------------------------------------------------------

    def _start_forcing(self) -> None:
        """Forcing starts after any forced ids the model already wrote (K3's `<|close|>` as the budget ran out)."""
        forced = self.budget.forced
        self._at = next(
            (n for n in range(min(len(forced) - 1, len(self._recent)), 0, -1) if self._recent[-n:] == list(forced[:n])),
            0,
        )
        self.tokens -= self._at  # those were the end's, not reasoning
        self._forced_text = "".join(self._piece(i) for i in forced[: self._at])
        self.state = FORCING

    def _forced(self, token_id: int) -> None:
        forced = self.budget.forced
        if token_id != forced[self._at]:  # a grammar that refused the forced id: the token is reasoning after all
            self.state = COUNTING
            self._count(token_id)
            return
        self._forced_text += self._piece(token_id)
        self._at += 1
        if self._at == len(forced):
            self.state = DONE

    def _count(self, token_id: int) -> None:
        piece = self._piece(token_id)
        before = len(self._text)
        self._text += piece
        self._lengths.append(len(piece))
        self.tokens += 1
        self._recent = [*self._recent, token_id][-len(self.budget.forced) :]
        found = min(
            (i for i in (self._text.find(end, max(0, before - len(end) + 1)) for end in self.budget.ends) if i >= 0),
            default=-1,
        )
        if found >= 0:
            self._uncount_from(found)
            self.state = DONE
            return
        if len(self._text) > 2 * _WINDOW:  # keep the tail only; the lengths follow it
            cut = len(self._text) - _WINDOW
            self._text = self._text[cut:]
            while self._lengths and cut > 0:
                cut -= self._lengths[0]
                self._lengths.pop(0)
            if cut < 0:
                self._lengths.insert(0, -cut)

    def _uncount_from(self, index: int) -> None:
        """The tokens that wrote text at or after `index` (an end marker's) were not reasoning."""
        end = len(self._text)
        for length in reversed(self._lengths):
            if end <= index:
                break
            self.tokens -= 1
            end -= length

    def _idle(self, token_id: int) -> None:
        """Reasoning opens only with `start` at the very start of the output (whitespace aside), as the parser
        reads it; anything else first means this output has none."""
        start = self.budget.start or ""
        self._text += self._piece(token_id)
        stripped = self._text.lstrip()
        if not stripped or (start.startswith(stripped) and stripped != start):
            return  # not known yet
        if stripped.startswith(start):
            self.state, self._text = COUNTING, ""
        else:
            self.state = DONE


def reasoning_tracker(params: SamplingParams, tokenizer: Any) -> ReasoningTracker | None:
    """The tracker of a choice with a thinking budget (None without one), reading token texts with `tokenizer`."""
    if params.reasoning_budget is None:
        return None
    decode = decoder_for(tokenizer)
    return ReasoningTracker(params.reasoning_budget, lambda token_id: decode([token_id]))
