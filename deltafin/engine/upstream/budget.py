"""A thinking budget in front of an upstream engine: the ids the upstream sends are watched against the budget
(deltafin.engine.text.reasoning_budget), and a generation that would write a reasoning token past it is stopped
there and resumed in a new upstream request whose prompt ends with the family's end of reasoning, forced.

vLLM (`thinking_token_budget`, with its server's `--reasoning-config`) and llama-server (`reasoning_budget_tokens`
and the family's tags) hold the budget themselves where they can, forcing the same end at the same count, and
then the watch never fires; SGLang has no per-request budget, and a vLLM without a reasoning config refuses the
field (the adapter then stops sending it), so there the watch is the budget. A resumed request continues the
choice: the same sampling, the tokens left of max_tokens, and the request's constraint as it reads once
reasoning ended (`ReasoningBudget.resume`); its prompt is the original one plus every id so far, which the
upstream's prefix cache holds.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from deltafin.engine.events import GenerationJob, TextDelta
from deltafin.engine.text.choice_decoder import ChoiceDecoder
from deltafin.engine.text.reasoning_budget import reasoning_tracker


class BudgetWatch:
    """One choice's ids, as the upstream sends them, against its thinking budget (a no-op without one)."""

    def __init__(self, job: GenerationJob, tokenizer: Any) -> None:
        self.job = job
        self._tracker = reasoning_tracker(job.params, tokenizer)
        #: every id the choice wrote so far, across its upstream requests
        self.written: list[int] = []

    @property
    def reasoning_tokens(self) -> int | None:
        return self._tracker.tokens if self._tracker is not None else None

    def keeps(self, token_id: int) -> bool:
        """Take `token_id` into the count; False (it is not taken) when it would put reasoning past the budget."""
        tracker = self._tracker
        if tracker is not None:
            if tracker.overruns(token_id):
                return False
            tracker.observe(token_id)
        self.written.append(token_id)
        return True

    def force_end(self, decoder: ChoiceDecoder) -> tuple[list[TextDelta], GenerationJob | None]:
        """After an overrun: the forced end of reasoning, written into the choice (as far as max_tokens lets it),
        and the job that continues the choice upstream (None: nothing is left to generate)."""
        assert self._tracker is not None
        params = self.job.params
        deltas = []
        for token_id in self._tracker.remaining_forced():
            if decoder.done or decoder.count >= params.max_tokens:
                break
            delta = decoder.push(token_id)
            self._tracker.observe(token_id)
            self.written.append(token_id)
            if delta is not None:
                deltas.append(delta)
        left = params.max_tokens - decoder.count
        if decoder.done or left <= 0:
            return deltas, None
        budget = params.reasoning_budget
        assert budget is not None
        resumed = GenerationJob(
            (*self.job.prompt_ids, *self.written),
            replace(params, max_tokens=left, reasoning_budget=None, constraint=budget.resume),
        )
        return deltas, resumed
