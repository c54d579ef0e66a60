"""Which prompt in prefill gets a step's prefill budget first.

Round-robin (each prompt a chunk in turn) keeps one long prompt from waiting for another's whole prefill. On top
of it, prompts that finish within this step's budget go first, in arrival order: a short request starts in the
next step whatever long prompts are mid-prefill, as vLLM schedules short prompts before long partial prefills.
A long prompt loses at most the budget those short ones take (admission bounds how many requests run at once).
"""

from __future__ import annotations

from collections import deque
from typing import Any


def finishing_first(prompts: deque[Any], budget: int) -> None:
    """Move the prompts whose remaining positions fit `budget` to the front of `prompts` (each has `.work`, None
    while its prefix is still read from disk, else with `.remaining`), keeping the order of both groups."""
    finishing = [p for p in prompts if _fits(p, budget)]
    if not finishing or all(p is q for p, q in zip(finishing, prompts)):
        return
    rest = [p for p in prompts if not _fits(p, budget)]
    prompts.clear()
    prompts.extend(finishing)
    prompts.extend(rest)


def _fits(prompt: Any, budget: int) -> bool:
    # a prompt whose prefill is not made yet has no known remainder: it keeps its round-robin place
    return prompt.work is not None and prompt.work.remaining <= budget
