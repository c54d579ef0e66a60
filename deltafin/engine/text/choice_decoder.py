"""Token ids of one choice -> `TextDelta`s and one `Finished`: the part every engine shares.

Whatever produced the ids (the local token loop, an upstream vLLM / SGLang / llama-server), Deltafin's own
detokenizer and stop matcher turn them into text, so one token sequence gives one response on every engine.
"""

from __future__ import annotations

from typing import Any

from deltafin.engine.events import Finished, FinishReason, TextDelta, TokenLogprob
from deltafin.engine.text.detokenizer import IncrementalDetokenizer
from deltafin.engine.text.stops import StopMatcher
from deltafin.protocol.sampling import SamplingParams


class ChoiceDecoder:
    """Feed generated ids one at a time with `push`; once `done` is set, no further id is read.

    The stop token itself is neither text nor reported in logprobs (as OpenAI does), but it counts as a
    completion token, as it does for the local engine.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams, stop_ids: frozenset[int], choice: int = 0) -> None:
        self.choice = choice
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stops = StopMatcher(params.stop)
        self._stop_ids = frozenset() if params.ignore_eos else stop_ids | frozenset(params.stop_token_ids)
        self._explicit_stop_ids = frozenset(params.stop_token_ids)
        self.count = 0
        self.done = False
        self.reason: FinishReason = "length"
        self.stop_reason: str | int | None = None

    def ends_at(self, token_id: int) -> bool:
        """Whether `token_id` is a stop id for this choice (its logprob is then never reported)."""
        return token_id in self._stop_ids or token_id in self._explicit_stop_ids

    def push(self, token_id: int, logprob: TokenLogprob | None = None) -> TextDelta | None:
        """The delta for one generated id (None once done); its text may be "" while text is held back."""
        if self.done:
            return None
        self.count += 1
        if self.ends_at(token_id):
            self.done, self.reason, self.stop_reason = True, "stop", token_id
            return TextDelta(self.choice, self._stops.flush(), (token_id,))
        text = self._stops.feed(self._detokenizer.push(token_id))
        if self._stops.matched is not None:
            self.done, self.reason, self.stop_reason = True, "stop", self._stops.matched
        return TextDelta(self.choice, text, (token_id,), (logprob,) if logprob is not None else ())

    def finish(
        self,
        reason: FinishReason | None,
        *,
        prompt_tokens: int,
        cached_tokens: int = 0,
        stop_reason: str | int | None = None,
        timings: dict[str, float] | None = None,
        reasoning_tokens: int | None = None,
    ) -> tuple[TextDelta | None, Finished]:
        """End the choice: the held-back text (if any) and the `Finished` event.

        `reason` is what the producer says ended generation (upstream `finish_reason`); it is used only when
        Deltafin did not end the choice itself (stop id or stop string seen in the ids). `reasoning_tokens`: the
        choice's reasoning tokens as its thinking budget counted them (deltafin.engine.text.reasoning_budget)."""
        tail = None
        if not self.done:
            held = self._stops.flush()
            tail = TextDelta(self.choice, held) if held else None
            self.done = True
            if reason is not None:
                self.reason = reason
                self.stop_reason = stop_reason
        finished = Finished(
            self.choice,
            self.reason,
            prompt_tokens,
            self.count,
            cached_tokens,
            self.stop_reason,
            timings=timings or {},
            reasoning_tokens=reasoning_tokens,
        )
        return tail, finished
