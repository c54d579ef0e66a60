"""Turns one row's logits into its next token: penalties, bias, constraint, temperature, top-k/p, min-p, draw.

Each row of a batch has its own `Sampler` (its own seed generator, penalty counts and constraint), so a row's
tokens never depend on the other rows. `sample` returns a 0-d device tensor: the engine stacks every row's
draw and moves them to the host in one transfer per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltafin.engine.events import TokenLogprob
from deltafin.engine.local.matcher import RowMatcher
from deltafin.engine.text.reasoning_budget import ReasoningTracker
from deltafin.protocol.sampling import SamplingParams

_FLOAT_MAX = torch.finfo(torch.float32).max


def logprob_entries(logits: torch.Tensor, targets: Sequence[int], top_k: int) -> list[TokenLogprob]:
    """logits: [N, V] raw model logits; targets: N token ids. Log-probabilities of each target under the model's
    own distribution (before any sampling knob) with the `top_k` most likely alternatives; one host transfer."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    index = torch.tensor(list(targets), device=logits.device).unsqueeze(-1)  # [N, 1]
    chosen = logprobs.gather(-1, index).squeeze(-1).tolist()  # [N]
    if not top_k:
        return [TokenLogprob(t, lp) for t, lp in zip(targets, chosen)]
    values, ids = torch.topk(logprobs, top_k, dim=-1)  # [N, k]
    return [
        TokenLogprob(t, lp, tuple(zip(row_ids, row_values)))
        for t, lp, row_ids, row_values in zip(targets, chosen, ids.tolist(), values.tolist())
    ]


class Sampler:
    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        device: torch.device,
        prompt_ids: Sequence[int],
        constraint: RowMatcher | None = None,
        reasoning: ReasoningTracker | None = None,
    ):
        self.params = params
        self.constraint = constraint
        #: the row's reasoning against its thinking budget: at the budget, the end of reasoning is forced
        self.reasoning = reasoning
        self._generator: torch.Generator | None = None
        if params.seed is not None and not params.greedy:
            # seed + choice index can leave the int64 range, which torch refuses: fold it back in.
            self._generator = torch.Generator(device=device).manual_seed(params.seed % (1 << 63))
        self._bias: torch.Tensor | None = None
        if params.logit_bias:
            self._bias = torch.zeros(vocab_size, device=device)
            ids = torch.tensor([token for token, _ in params.logit_bias], device=device)
            self._bias[ids] = torch.tensor([value for _, value in params.logit_bias], device=device)
        # [V] occurrence counts of generated tokens (OpenAI penalties) and a mask of every seen token
        # (HF repetition penalty, which also covers the prompt).
        self._counts: torch.Tensor | None = None
        if params.presence_penalty or params.frequency_penalty:
            self._counts = torch.zeros(vocab_size, device=device)
        self._seen: torch.Tensor | None = None
        #: greedy with nothing to apply: the argmax of the raw logits (one operator a row, the common case)
        self._plain_greedy = (
            params.greedy
            and constraint is None
            and not params.logit_bias
            and not (params.presence_penalty or params.frequency_penalty)
            and params.repetition_penalty == 1.0
        )
        if params.repetition_penalty != 1.0:
            self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if prompt_ids:
                self._seen[torch.tensor(list(prompt_ids), device=device)] = True

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to apply: the token is the argmax of the raw float32 logits, so a caller may take
        the argmax of many positions at once (speculative verification) and get what `sample` would. Not while
        the row's thinking budget may still force the end of reasoning: a forced token is no argmax."""
        return self._plain_greedy and (self.reasoning is None or self.reasoning.over)

    def observe(self, token_id: int) -> None:
        """The row emitted `token_id`: update penalty state and advance the constraint."""
        if self._counts is not None:
            self._counts[token_id] += 1
        if self._seen is not None:
            self._seen[token_id] = True
        if self.constraint is not None:
            self.constraint.accept(token_id)
        if self.reasoning is not None:
            self.reasoning.observe(token_id)

    @property
    def terminated(self) -> bool:
        return self.constraint is not None and self.constraint.is_terminated()

    def _allowed(self, token_id: int, logits: torch.Tensor) -> bool:
        """Whether the row's grammar lets `token_id` come next (every reasoning grammar ends with the family's
        end of reasoning, so a forced end is allowed; were it not, the grammar would win). One host sync, on
        the few steps that force a token."""
        if self.constraint is None:
            return True
        probe = torch.zeros_like(logits, dtype=torch.float32)
        self.constraint.fill_mask(probe)
        return bool(torch.isfinite(probe[token_id]))

    def logprob(self, logits: torch.Tensor, token_id: int, top_k: int | None = None) -> TokenLogprob:
        """Log-probability of `token_id` under the model's own distribution (before sampling knobs),
        with the `top_k` (default: top_logprobs) most likely alternatives."""
        k = self.params.top_logprobs if top_k is None else top_k
        return logprob_entries(logits.unsqueeze(0), [token_id], k)[0]

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [V] for the last position; returns the drawn token as a 0-d int64 tensor (no host sync)."""
        forced = self.reasoning.next_forced() if self.reasoning is not None else None
        if forced is not None and self._allowed(forced, logits):
            return torch.tensor(forced, device=logits.device)
        if self._plain_greedy and logits.dtype == torch.float32:
            return torch.argmax(logits)  # model logits are finite: nothing for the guard below to fix
        p = self.params
        logits = logits.float()
        if self._seen is not None:
            penalized = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(self._seen, penalized, logits)
        if self._counts is not None:
            logits = logits - p.frequency_penalty * self._counts - p.presence_penalty * (self._counts > 0)
        if self._bias is not None:
            logits = logits + self._bias
        if self.constraint is not None:
            logits = logits.clone()  # fill_mask works in place; the raw logits still serve logprobs
            self.constraint.fill_mask(logits)
        if not p.greedy:
            logits = logits / p.temperature
        # Extreme penalties, biases or temperatures overflow to +inf (and inf - inf to nan): keep every value
        # finite except the -inf of tokens that are ruled out, so the ranking survives and softmax stays sane.
        logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=_FLOAT_MAX, neginf=float("-inf"))
        best = torch.argmax(logits)
        if p.greedy:
            return best
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > p.top_p
            sorted_probs = sorted_probs.masked_fill(outside, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        # multinomial refuses inf/nan/negative or all-zero rows; fall back to the argmax on the device, without
        # asking the host whether that happened.
        usable = torch.isfinite(probs).all() & (probs.sum() > 0)
        fallback = torch.nn.functional.one_hot(best, probs.shape[-1]).to(probs.dtype)  # [V]
        probs = torch.where(usable, probs, fallback)
        return torch.multinomial(probs, 1, generator=self._generator)[0]
