"""The model steps: prefill one prompt into its own KV cache, then decode one token for every running row.

Named steps after gpt-fast: `prefill` runs a prompt (in chunks, so neither activations nor prompt logprobs
ever hold more than `chunk` positions of logits), `decode_step` runs one token per row of the batch.
Both stay on the device: the only host transfer per step is the sampled ids, done by the caller.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch

from deltafin.engine.events import TokenLogprob
from deltafin.engine.sampler import logprob_entries

#: prompt positions run per forward pass during prefill; bounds the [chunk, V] logits prompt logprobs need
PREFILL_CHUNK = 512


def cache_argument(model: Any) -> str:
    """transformers 5 renamed `past_key_values` to `cache`; remote-code models may still use the old name."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def prefill(
    model: Any,
    ids: Sequence[int],
    cache: Any,
    cached: int,
    *,
    cache_arg: str = "cache",
    chunk: int = PREFILL_CHUNK,
    prompt_logprobs: int | None = None,
) -> tuple[torch.Tensor, list[TokenLogprob | None]]:
    """Runs `ids[cached:]` into `cache` (which already holds `ids[:cached]`); returns the next-token logits [V]
    and, when `prompt_logprobs` (top-k count) is not None, the prompt's logprobs ([None, lp(t1|t0), ...]).

    Prompt logprobs need logits at every position, so the caller passes `cached=0` for them; they are computed
    chunk by chunk and only the returned entries are kept (an 8k prompt never holds [8k, V] logits)."""
    device = next(model.parameters()).device
    want = prompt_logprobs is not None
    entries: list[TokenLogprob | None] = [None] if want else []
    logits = None
    for start in range(cached, len(ids), chunk):
        piece = ids[start : start + chunk]
        out = model(
            input_ids=torch.tensor([piece], device=device),  # [1, C]
            use_cache=True,
            logits_to_keep=0 if want else 1,
            **{cache_arg: cache},
        )
        logits = out.logits[0]  # [C, V] (prompt logprobs) or [1, V]
        if want:
            # logits[i] predicts token start+i+1; the chunk's last row may predict the first new token instead.
            targets = ids[start + 1 : start + 1 + len(piece)]
            entries.extend(logprob_entries(logits[: len(targets)], targets, prompt_logprobs))
        del out
    assert logits is not None, "prefill needs at least one token not in the cache"
    return logits[-1], entries


def decode_step(
    model: Any,
    tokens: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    cache: Any,
    *,
    cache_arg: str = "cache",
) -> torch.Tensor:
    """tokens: [B, 1] the last sampled token of each row; attention_mask: [B, L+1] (0 = left padding);
    positions: [B, 1] each row's own position. Returns logits [B, V]."""
    out = model(
        input_ids=tokens,
        attention_mask=attention_mask,
        position_ids=positions,
        use_cache=True,
        **{cache_arg: cache},
    )
    return out.logits[:, -1]


def compiled_decode_step(backend: str = "inductor", step: Any = decode_step) -> Any:
    """`step` under torch.compile. Shapes vary only in the batch size and the cache length, both marked
    dynamic on first sight, so the graph is captured once per batch bucket instead of once per step."""
    return torch.compile(step, backend=backend, dynamic=True)


def decode_step_for(model: Any, *, compile: bool = False, backend: str = "inductor") -> Any:
    """The fastest decode step that covers `model`: the fused one of its architecture where there is one
    (`deltafin.engine.fused_llama`), else transformers' forward (`decode_step`).

    With `compile`, the fused step runs with static shapes per (row bucket, capacity bucket)
    (`deltafin.engine.fused_static`); transformers' forward keeps `torch.compile(dynamic=True)`."""
    from deltafin.engine.fused_llama import FusedLlamaStep, fused_llama_step
    from deltafin.engine.fused_static import StaticFusedStep

    fused = fused_llama_step(model)
    if fused is None:
        return compiled_decode_step(backend, decode_step) if compile else decode_step
    if not isinstance(fused, FusedLlamaStep):  # GGUF blocks: the whole step is one C call, nothing to compile
        return fused
    return StaticFusedStep(fused, backend=backend) if compile else fused
