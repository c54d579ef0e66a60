"""What one more token fed to a pass costs, relative to a one-token decode step, measured on this machine.

A pass over T tokens takes about a + b T seconds: `a` is what every pass pays (the weights read once, the
step's Python), `b` what each token adds (its share of the matmuls, its attention, its logits). A one-token step
costs a + b, so one more token costs c = b / (a + b) of it: the planner's price of a guess. c depends on the
machine, the model, the kind of step and how busy the cores are (on the 2-core machine with the default model
it is about 0.2-0.25 whether 1 or 8 rows are in the pass: a pass of several tokens is compute-bound), so it is
fitted to the passes the engine runs: a least-squares line through (tokens, seconds), older passes weighing
less, pulled toward the prior c0 (the kind of step's constant) by `PRIOR_WEIGHT` passes' worth. The tokens a
pass is fed vary with the rows in the batch as well as with the drafts, and the steps without a draft are timed
too, so the line is found (and kept up to date) even while no row drafts; while the tokens do not vary at all, c
stays at the prior.

A pass much slower than the line predicts (the process preempted, a cache reallocated) would move the line far:
at 8 rows the passes lie at 8 to 24 tokens, and a is the line carried back to 0. So a pass counts as at most
`CLIP` times the passes' usual distance from the line (and at least `LEAST` of the prediction) away from it: one
stall does not make guesses look expensive for the next hundred passes, and a machine that really became slower
moves the line a step at a time. Until that distance is measured it is taken as `FIRST_SPREAD` (worth
`FIRST_SPREAD_WEIGHT` passes in its mean), so a stall
among the first passes (a first call's allocations, the process starting up) is clipped too: unclipped, one
such pass could put c at 1, where no guess pays and the line then learns only from steps of one size.
"""

from __future__ import annotations

#: how much earlier passes still weigh at each new one (about the last few hundred passes count)
DECAY = 0.995
#: how many passes' worth the prior's split of a pass's time into a and b weighs
PRIOR_WEIGHT = 4.0
#: a pass counts as at most this many times the usual relative distance from the line away from it ...
CLIP = 3.0
#: ... or this share of the prediction, whichever is more ...
LEAST = 0.05
#: the usual distance assumed before passes have measured it (passes on a shared 2-core machine vary ~10-20%),
#: worth this many passes in its running mean
FIRST_SPREAD, FIRST_SPREAD_WEIGHT = 0.2, 8.0
#: the range c is kept in (a fit on few, noisy passes can say anything)
LOWEST, HIGHEST = 0.01, 1.0


class TokenCost:
    """c, the relative cost of a token (see the module docstring), from `record`ed passes, starting at `prior`."""

    def __init__(self, prior: float) -> None:
        self.prior = min(max(prior, LOWEST), HIGHEST)
        self._sums = [0.0] * 5  # decayed sums of 1, T, T^2, y, T y
        self._line: tuple[float, float] | None = None  # (a, b) seconds
        self._relative = self.prior
        self._spread = FIRST_SPREAD  # decayed mean of |seconds / predicted - 1|
        #: a value set by hand (tests): the measurements are still recorded but not used
        self.pinned: float | None = None
        #: passes recorded (tests read it)
        self.passes = 0

    @property
    def relative(self) -> float:
        return self.pinned if self.pinned is not None else self._relative

    @property
    def line(self) -> tuple[float, float] | None:
        """(a, b) in seconds, once a pass was recorded."""
        return self._line

    def record(self, tokens: int, seconds: float) -> None:
        """A pass over `tokens` tokens took `seconds`."""
        if tokens <= 0 or not seconds > 0:
            return
        self.passes += 1
        n, t1, t2, y1, ty = self._sums
        if self._line is not None:
            a, b = self._line
            predicted = a + b * tokens
            if predicted > 0:
                off = seconds / predicted - 1
                weight = max(1 - DECAY, 1 / (self.passes + FIRST_SPREAD_WEIGHT))
                self._spread = self._spread * (1 - weight) + weight * min(abs(off), 1.0)
                most = max(CLIP * self._spread, LEAST)
                seconds = predicted * (1 + min(max(off, -most), most))
        self._sums = [
            n * DECAY + 1.0,
            t1 * DECAY + tokens,
            t2 * DECAY + tokens * tokens,
            y1 * DECAY + seconds,
            ty * DECAY + tokens * seconds,
        ]
        self._fit()

    def _fit(self) -> None:
        """Minimizes sum w (y - a - b T)^2 + PRIOR_WEIGHT ((1 - c0) b - c0 a)^2: the penalty is zero exactly
        where b / (a + b) = c0, so with every pass at one T the fit has a + b T through the data and c = c0."""
        n, t1, t2, y1, ty = self._sums
        c0, lam = self.prior, PRIOR_WEIGHT
        m00, m01, m11 = n + lam * c0 * c0, t1 - lam * c0 * (1 - c0), t2 + lam * (1 - c0) ** 2
        det = m00 * m11 - m01 * m01
        if det <= 0:
            return
        a = (y1 * m11 - m01 * ty) / det
        b = (m00 * ty - m01 * y1) / det
        self._line = (a, b)
        one = a + b
        self._relative = min(max(b / one, LOWEST), HIGHEST) if one > 0 and b > 0 else (LOWEST if one > 0 else HIGHEST)
