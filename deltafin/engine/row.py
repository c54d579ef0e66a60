"""One running choice (a row of the batch): its sampler, detokenizer and stop matcher, and what it emits.

A row never looks at other rows: everything that decides its tokens (sampler state, seed generator,
constraint, stop strings and ids, budget) is its own, so its output does not depend on what runs beside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from deltafin.engine.detokenizer import IncrementalDetokenizer
from deltafin.engine.events import Finished, GenerationJob, TextDelta
from deltafin.engine.sampler import Sampler
from deltafin.engine.stops import StopMatcher
from deltafin.engine.stream import GenerationStream


@dataclass(eq=False)
class Submission:
    """The choices of one request; the stream ends when its last row has left the batch."""

    stream: GenerationStream
    jobs: tuple[GenerationJob, ...]
    rows_left: int = 0
    ended: bool = False

    def row_left(self) -> None:
        self.rows_left -= 1
        if self.rows_left == 0 and not self.ended:
            self.ended = True
            self.stream.end()

    def fail(self, error: Any) -> None:
        if not self.ended:
            self.ended = True
            self.stream.fail(error)


@dataclass(eq=False)
class Row:
    submission: Submission
    choice: int
    sampler: Sampler
    detokenizer: IncrementalDetokenizer
    stops: StopMatcher
    stop_ids: frozenset[int]
    max_new: int
    prompt_len: int
    cached: int
    started: float
    #: tokens whose keys/values are in the cache (the prompt, then every fed token)
    ids: list[int] = field(default_factory=list)
    #: the last sampled token, fed to the model at the next step
    pending: int | None = None
    count: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def stream(self) -> GenerationStream:
        return self.submission.stream

    def take(self, token_id: int, logits: torch.Tensor) -> bool:
        """Handles the row's next token (logits: [V], the raw distribution it came from); True when finished."""
        params = self.sampler.params
        emit = self.stream.emit
        self.count += 1
        if token_id in self.stop_ids and not params.ignore_eos:
            # The stop token itself is neither text nor reported in logprobs (as OpenAI does).
            emit(TextDelta(self.choice, self.stops.flush(), (token_id,)))
            return self._finish("stop", token_id)
        logprobs = (self.sampler.logprob(logits, token_id),) if params.logprobs else ()
        self.sampler.observe(token_id)
        text = self.stops.feed(self.detokenizer.push(token_id))
        emit(TextDelta(self.choice, text, (token_id,), logprobs))
        if self.stops.matched is not None:
            return self._finish("stop", self.stops.matched)
        if self.sampler.terminated:  # the constraint's grammar is complete
            emit(TextDelta(self.choice, self.stops.flush()))
            return self._finish("stop", None)
        if self.count >= self.max_new:
            emit(TextDelta(self.choice, self.stops.flush()))
            return self._finish("length", None)
        self.pending = token_id
        return False

    def finish_empty(self) -> None:
        """No room for a single new token (the prompt fills the context)."""
        self.stream.emit(TextDelta(self.choice, ""))
        self._finish("length", None)

    def _finish(self, reason: str, stop_reason: str | int | None) -> bool:
        self.timings["total_s"] = time.perf_counter() - self.started
        end = Finished(self.choice, reason, self.prompt_len, self.count, self.cached, stop_reason,  # type: ignore[arg-type]
                       timings=self.timings)
        self.stream.emit(end)
        return True
