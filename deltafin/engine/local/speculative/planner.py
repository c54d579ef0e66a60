"""How many tokens each row may draft this step: as many as pay for themselves, judged by the row's acceptance.

A guess costs the pass a token's worth of compute whether it is accepted or not (c of a one-token decode step,
measured: deltafin.engine.local.speculative.cost); it yields a token only if every guess before it was accepted
too. With a row's acceptance rate a, its j-th guess yields a^j tokens on average. A step's throughput is (tokens
it yields) / (what it costs): 1 + c (T - 1) for T tokens fed, in units of a one-token step. Guesses are taken,
over all rows, in the order of what they yield, while each yields more than it costs at the step's current
throughput (the ratio only grows while that holds): a copying row drafts long runs, a row whose guesses fail
stops guessing, and a full batch (already many tokens per pass, so a guess must yield more) guesses only where
acceptance is high, and not at all where guesses cost nearly a whole step.

A row's rate is the share of its recent guesses accepted, older steps weighing less, starting from a prior worth
`PRIOR_WEIGHT` guesses: the share of all rows' recent guesses accepted (`PRIOR` before any), so a row that joins
a batch of rows copying their prompts starts where they are, and one joining rows whose guesses fail starts low.
A row that stopped guessing drifts back toward that prior, so it tries again after a while: text that starts
repeating itself is noticed. What is known of a rate is uncertain while it rests on few guesses, and a guess that
does not pay on average can still pay by what it teaches: a row's first guess of a step is judged by its rate
plus its standard error (`EXPLORE`), so a new row in a full batch tries one guess (where its rate alone would
keep it from guessing, and the batch would never learn it copies), and a row whose guesses keep failing stops.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deltafin.engine.local.speculative.cost import TokenCost

PRIOR = 0.7
PRIOR_WEIGHT = 2.0
#: how much the counts of earlier steps still weigh at each new step with guesses ...
DECAY = 0.8
#: ... and at each step without (the rate drifts back toward the prior)
IDLE_DECAY = 0.95
#: a row's first guess of a step is judged by its rate plus this many standard errors of it: a row the planner
#: knows little about (new, or idle a while) tries one guess where its rate alone would not pay, so a batch
#: of rows that copy their prompts finds out, and a row whose guesses fail stops trying once its rate is known
EXPLORE = 1.0
#: how much all rows' earlier guesses still weigh at each row's next step (the prior of every row)
OVERALL_DECAY = 0.99


@dataclass
class _Rate:
    accepted: float = 0.0
    tested: float = 0.0

    def value(self, prior: float) -> float:
        return (self.accepted + prior * PRIOR_WEIGHT) / (self.tested + PRIOR_WEIGHT)


class DraftPlanner:
    def __init__(self, most: int, cost: TokenCost | float) -> None:
        self.most = most
        self.cost = cost if isinstance(cost, TokenCost) else TokenCost(cost)
        self._rates: weakref.WeakKeyDictionary[Any, _Rate] = weakref.WeakKeyDictionary()
        self._overall = _Rate()

    @property
    def token_cost(self) -> float:
        """c: one more token fed, relative to a one-token step (measured, unless pinned by setting it)."""
        return max(self.cost.relative, 1e-6)

    @token_cost.setter
    def token_cost(self, value: float) -> None:
        self.cost.pinned = value

    @property
    def prior(self) -> float:
        """A row's rate before its own guesses: all rows' recent acceptance."""
        return self._overall.value(PRIOR)

    def rate(self, row: Any) -> float:
        found = self._rates.get(row)
        return found.value(self.prior) if found is not None else self.prior

    def limits(self, rows: Sequence[Any], room: Sequence[int]) -> list[int]:
        """Guesses each row may draft this step; `room[i]`: the most row i can use (its budget, the context)."""
        prior = self.prior
        rates, hopes = [], []
        for row in rows:
            found = self._rates.get(row) or _Rate()
            rate = found.value(prior)
            rates.append(rate)
            hopes.append(min(1.0, rate + EXPLORE * math.sqrt(rate * (1 - rate) / (found.tested + PRIOR_WEIGHT))))
        token_cost = self.token_cost
        limits = [0] * len(rows)
        yielded, cost = float(len(rows)), 1.0 + token_cost * (len(rows) - 1)
        # each row's next guess yields rate^(j+1) (its first is judged by its hope); take the best one while it
        # pays at the current throughput
        while True:
            best, gain, expected = -1, 0.0, 0.0
            for i, rate in enumerate(rates):
                if limits[i] < min(self.most, room[i]):
                    candidate = rate ** (limits[i] + 1) if limits[i] else hopes[i]
                    if candidate > gain:
                        best, gain, expected = i, candidate, rate ** (limits[i] + 1)
            if best < 0 or gain <= token_cost * yielded / cost:
                return limits
            limits[best] += 1
            yielded += expected
            cost += token_cost

    def record(self, row: Any, accepted: int, tested: int) -> None:
        """A step checked `tested` of the row's guesses (up to and with the first rejected one), `accepted` held."""
        rate = self._rates.get(row)
        if rate is None:
            rate = self._rates[row] = _Rate()
        decay = DECAY if tested else IDLE_DECAY
        rate.accepted = rate.accepted * decay + accepted
        rate.tested = rate.tested * decay + tested
        overall = self._overall  # steps without guesses make it forget too: it drifts back toward PRIOR
        overall.accepted = overall.accepted * OVERALL_DECAY + accepted
        overall.tested = overall.tested * OVERALL_DECAY + tested
