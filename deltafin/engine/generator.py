"""The token loop: prefill the prompt into a KV cache, then decode one token per step.

Named steps after gpt-fast: `prefill` and `decode_one_token` run the model, `generate_tokens` yields
(token, logprob) until a stop token, the token budget or a cancel request.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from deltafin.engine.events import TokenLogprob
from deltafin.engine.prefix_cache import PrefixCache
from deltafin.engine.sampler import Sampler


@dataclass(frozen=True)
class TokenStep:
    token_id: int
    logprob: TokenLogprob | None
    is_stop_token: bool


def prefill(model: Any, input_ids: torch.Tensor, cache: Any, start: int) -> torch.Tensor:
    """input_ids: [1, S] new prompt tokens at positions start..start+S; returns logits [V] of the last one."""
    positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
    out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, cache_position=positions, logits_to_keep=1)
    return out.logits[0, -1]


def decode_one_token(model: Any, token: torch.Tensor, cache: Any, position: int) -> torch.Tensor:
    """token: [1, 1]; returns logits [V] for the next position."""
    positions = torch.tensor([position], device=token.device)
    out = model(input_ids=token, past_key_values=cache, use_cache=True, cache_position=positions)
    return out.logits[0, -1]


def generate_tokens(
    model: Any,
    prefix_cache: PrefixCache,
    prompt_ids: Sequence[int],
    sampler: Sampler,
    *,
    max_new_tokens: int,
    stop_token_ids: frozenset[int],
    cancel: threading.Event,
    on_prefilled: Callable[[int], None] = lambda cached: None,
) -> Iterator[TokenStep]:
    device = next(model.parameters()).device
    cache, cached = prefix_cache.take(prompt_ids)
    ids = list(prompt_ids)
    with torch.inference_mode():
        logits = prefill(model, torch.tensor([ids[cached:]], device=device), cache, cached)
        on_prefilled(cached)
        for step in range(max_new_tokens):
            if cancel.is_set():
                break
            token_id = sampler.sample(logits)
            logprob = sampler.logprob(logits, token_id) if sampler.params.logprobs else None
            is_stop = token_id in stop_token_ids and not sampler.params.ignore_eos
            yield TokenStep(token_id, logprob, is_stop)
            if is_stop or step + 1 == max_new_tokens:
                break
            sampler.observe(token_id)
            ids.append(token_id)
            logits = decode_one_token(model, torch.tensor([[token_id]], device=device), cache, len(ids) - 1)
    # Only the tokens whose keys/values are in the cache are offered to the next request.
    prefix_cache.give_back(cache, ids)
