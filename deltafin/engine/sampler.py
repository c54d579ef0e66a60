"""Turns one step's logits into the next token: penalties, bias, temperature, top-k/p, min-p, seeded draw."""

from __future__ import annotations

from typing import Sequence

import torch

from deltafin.engine.events import TokenLogprob
from deltafin.protocol.sampling import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device, prompt_ids: Sequence[int]):
        self.params = params
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
        if params.repetition_penalty != 1.0:
            self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if prompt_ids:
                self._seen[torch.tensor(list(prompt_ids), device=device)] = True

    def observe(self, token_id: int) -> None:
        if self._counts is not None:
            self._counts[token_id] += 1
        if self._seen is not None:
            self._seen[token_id] = True

    def logprob(self, logits: torch.Tensor, token_id: int, top_k: int | None = None) -> TokenLogprob:
        """Log-probability of `token_id` under the model's own distribution (before sampling knobs),
        with the `top_k` (default: top_logprobs) most likely alternatives."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        k = self.params.top_logprobs if top_k is None else top_k
        if k:
            values, ids = torch.topk(logprobs, k)
            top = tuple(zip(ids.tolist(), values.tolist()))
        return TokenLogprob(token_id, float(logprobs[token_id]), top)

    def sample(self, logits: torch.Tensor) -> int:
        """logits: [V] for the last position."""
        p = self.params
        logits = logits.float()
        if self._seen is not None:
            penalized = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(self._seen, penalized, logits)
        if self._counts is not None:
            logits = logits - p.frequency_penalty * self._counts - p.presence_penalty * (self._counts > 0)
        if self._bias is not None:
            logits = logits + self._bias
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
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
        return int(torch.multinomial(probs, 1, generator=self._generator))
