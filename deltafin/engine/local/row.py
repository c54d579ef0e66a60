"""One running choice (a row of the batch): its sampler and its decoder (detokenizer, stops), and what it emits.

A row never looks at other rows: everything that decides its tokens (sampler state, seed generator,
constraint, stop strings and ids, budget) is its own, so its output does not depend on what runs beside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from deltafin.engine.events import FinishReason, GenerationJob, TextDelta
from deltafin.engine.local.sampler import Sampler
from deltafin.engine.stream import GenerationStream
from deltafin.engine.text.choice_decoder import ChoiceDecoder
from deltafin.engine.timeline import Mark, now_ns


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
    #: ids -> text, stop ids and strings: the same decoder the upstream engines use
    decoder: ChoiceDecoder
    max_new: int
    prompt_len: int
    cached: int
    started: float
    #: tokens whose keys/values are in the cache (the prompt, then every fed token)
    ids: list[int] = field(default_factory=list)
    #: the last sampled token, fed to the model at the next step
    pending: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    #: when a traced request's row started decoding (its prompt's prefill ended; deltafin.engine.timeline)
    joined_ns: int = 0

    @property
    def stream(self) -> GenerationStream:
        return self.submission.stream

    def take(self, token_id: int, logits: torch.Tensor) -> bool:
        """Handles the row's next token (logits: [V], the raw distribution it came from); True when finished."""
        decoder = self.decoder
        logprob = None
        if self.sampler.params.logprobs and not decoder.ends_at(token_id):
            logprob = self.sampler.logprob(logits, token_id)
        self.stream.emit(decoder.push(token_id, logprob))  # type: ignore[arg-type]  # push returns None only once done, and a finished row takes no token
        if decoder.done:  # a stop id or a stop string
            return self._finish(None)
        self.sampler.observe(token_id)
        if self.sampler.terminated:  # the constraint's grammar is complete
            return self._finish("stop")
        if decoder.count >= self.max_new:
            return self._finish("length")
        self.pending = token_id
        return False

    def finish_empty(self) -> None:
        """No room for a single new token (the prompt fills the context)."""
        self.stream.emit(TextDelta(self.choice, ""))
        self._finish("length")

    def _finish(self, reason: FinishReason | None) -> bool:
        self.timings["total_s"] = time.perf_counter() - self.started
        reasoning = self.sampler.reasoning
        tail, end = self.decoder.finish(
            reason,
            prompt_tokens=self.prompt_len,
            cached_tokens=self.cached,
            timings=self.timings,
            reasoning_tokens=reasoning.tokens if reasoning is not None else None,
        )
        if tail is not None:
            self.stream.emit(tail)
        self.stream.emit(end)
        timeline = self.stream.timeline
        if timeline is not None:
            attributes: dict[str, Any] = {
                "deltafin.choice": self.choice,
                "gen_ai.usage.output_tokens": end.completion_tokens,
                "gen_ai.response.finish_reasons": (end.reason,),
            }
            timeline.add(Mark("decode", self.joined_ns or now_ns(), now_ns(), attributes))
        return True
