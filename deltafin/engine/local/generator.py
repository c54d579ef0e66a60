"""The model steps: prefill one prompt into its own KV cache, then decode one token for every running row.

Named steps after gpt-fast: `prefill` runs a prompt (in windows, so neither activations nor prompt logprobs
ever hold more than `chunk` positions of logits), `decode_step` runs one token per row of the batch.
`PromptPrefill` is the same prefill a window at a time, for chunked prefill: the local engine runs windows of
a long prompt between decode steps of the running batch, into the same one-row cache.
Both stay on the device: the only host transfer per step is the sampled ids, done by the caller.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from deltafin.engine.events import TokenLogprob
from deltafin.engine.kv.checkpoints import book_of
from deltafin.engine.local.sampler import logprob_entries

#: prompt positions run per forward pass during prefill; bounds the [chunk, V] logits prompt logprobs need,
#: and (engine.prefill_chunk_tokens) how long a prefill holds up the running rows' next decode step
PREFILL_CHUNK = 128


def cache_argument(model: Any) -> str:
    """transformers 5 renamed `past_key_values` to `cache`; remote-code models may still use the old name."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class PromptPrefill:
    """Runs `ids[cached:]` into `cache` (which already holds `ids[:cached]`), `run(n)` positions at a time.

    Once `done`: `logits` are the next-token logits [V] and, when `prompt_logprobs` (top-k count) is not None,
    `entries` the prompt's logprobs ([None, lp(t1|t0), ...]). Prompt logprobs need logits at every position, so
    the caller passes `cached=0` for them; they are computed window by window and only the entries are kept (an
    8k prompt never holds [8k, V] logits). Any split into windows leaves the cache as one pass would."""

    def __init__(
        self,
        model: Any,
        ids: Sequence[int],
        cache: Any,
        cached: int,
        *,
        cache_arg: str = "cache",
        prompt_logprobs: int | None = None,
    ) -> None:
        assert cached < len(ids), "prefill needs at least one token not in the cache"
        self.model = model
        self.ids = ids
        self.cache = cache
        self.position = cached
        self.cache_arg = cache_arg
        self.prompt_logprobs = prompt_logprobs
        self.device = next(model.parameters()).device
        self.entries: list[TokenLogprob | None] = [None] if prompt_logprobs is not None else []
        self.logits: torch.Tensor | None = None  # [V], the last window's last position

    @property
    def remaining(self) -> int:
        return len(self.ids) - self.position

    @property
    def done(self) -> bool:
        return self.position >= len(self.ids)

    def run(self, positions: int) -> None:
        """The next `positions` prompt tokens (fewer at the end of the prompt): one forward pass, or one per
        stretch between the checkpoints of the cache's book (`deltafin.engine.kv.checkpoints`), which copies a
        hybrid model's states wherever the cache stands on one."""
        end = min(self.position + max(1, positions), len(self.ids))
        book = book_of(self.cache)
        while self.position < end:
            stop = book.next_stop(self.position) if book is not None else None
            self._window(min(end, stop) - self.position if stop is not None else end - self.position)
            if book is not None:
                book.reached(self.cache, self.position)

    def _window(self, positions: int) -> None:
        """One forward pass over the next `positions` prompt tokens."""
        start = self.position
        piece = self.ids[start : start + max(1, positions)]
        want = self.prompt_logprobs is not None
        out = self.model(
            input_ids=torch.tensor([piece], device=self.device),  # [1, C]
            use_cache=True,
            logits_to_keep=0 if want else 1,
            **{self.cache_arg: self.cache},
        )
        logits = out.logits[0]  # [C, V] (prompt logprobs) or [1, V]
        if self.prompt_logprobs is not None:
            # logits[i] predicts token start+i+1; the window's last row may predict the first new token instead.
            targets = self.ids[start + 1 : start + 1 + len(piece)]
            self.entries.extend(logprob_entries(logits[: len(targets)], targets, self.prompt_logprobs))
        self.logits = logits[-1]
        self.position = start + len(piece)
        del out


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
    """The whole prefill at once, in windows of `chunk` positions (see PromptPrefill): (logits [V], entries)."""
    work = PromptPrefill(model, ids, cache, cached, cache_arg=cache_arg, prompt_logprobs=prompt_logprobs)
    while not work.done:
        work.run(chunk)
    assert work.logits is not None
    return work.logits, work.entries


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
