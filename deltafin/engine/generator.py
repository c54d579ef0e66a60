"""The token loop: prefill the prompt into a KV cache, then decode one token per step.

Named steps after gpt-fast: `prefill` and `decode_one_token` run the model, `generate_tokens` yields
(token, logprob) until a stop token, the token budget or a cancel request.
"""

from __future__ import annotations

import inspect
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


# Positions follow from the cache's length, so a cache cropped to a shared prefix continues correctly.


def cache_argument(model: Any) -> str:
    """transformers 5 renamed `past_key_values` to `cache`; remote-code models may still use the old name."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def prefill(model: Any, input_ids: torch.Tensor, cache: dict[str, Any], *, all_logits: bool = False) -> torch.Tensor:
    """input_ids: [1, S] prompt tokens not yet in the cache; returns logits [S, V] (all_logits) or [1, V]."""
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=0 if all_logits else 1, **cache)
    return out.logits[0]


def decode_one_token(model: Any, token: torch.Tensor, cache: dict[str, Any]) -> torch.Tensor:
    """token: [1, 1]; returns logits [V] for the next position."""
    out = model(input_ids=token, use_cache=True, **cache)
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
    cache_arg: str = "cache",
    on_prefilled: Callable[[int], None] = lambda cached: None,
    on_prompt_logprobs: Callable[[list[TokenLogprob | None]], None] = lambda entries: None,
) -> Iterator[TokenStep]:
    device = next(model.parameters()).device
    want_prompt = sampler.params.prompt_logprobs is not None
    # Prompt logprobs need logits at every prompt position, so nothing may come from the cache.
    cache, cached = prefix_cache.take(() if want_prompt else prompt_ids)
    cache_kw = {cache_arg: cache}
    ids = list(prompt_ids)
    with torch.inference_mode():
        all_logits = prefill(model, torch.tensor([ids[cached:]], device=device), cache_kw, all_logits=want_prompt)
        logits = all_logits[-1]
        on_prefilled(cached)
        if want_prompt:
            # logits[i] predicts token i+1: [None, lp(t1 | t0), lp(t2 | t0 t1), ...]
            on_prompt_logprobs([None] + [sampler.logprob(all_logits[i], ids[i + 1], sampler.params.prompt_logprobs)
                                         for i in range(len(ids) - 1)])
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
            logits = decode_one_token(model, torch.tensor([[token_id]], device=device), cache_kw)
    # Only the tokens whose keys/values are in the cache are offered to the next request.
    prefix_cache.give_back(cache, ids)
