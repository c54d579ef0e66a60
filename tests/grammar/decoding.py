"""A hand-written greedy decode loop with a RowMatcher, the way the batched sampler applies one: mask after
penalties/bias (none here), before the (greedy) choice; accept; stop on a stop token or a terminated grammar."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from deltafin.engine.local.generator import cache_argument
from deltafin.engine.local.matcher import RowMatcher
from deltafin.grammar.compiled import ReadyGrammar, compile_now, tokenizer_info
from deltafin.protocol.sampling import Constraint


def grammar_compiler(tokenizer, vocab_size: int, stop_ids):
    """Constraint -> ReadyGrammar, compiled in this thread (what the worker processes do for the server)."""
    info = tokenizer_info(tokenizer, vocab_size, stop_ids)
    compiled: dict[Constraint, ReadyGrammar] = {}

    def ready(constraint: Constraint) -> ReadyGrammar:
        if constraint not in compiled:
            compiled[constraint] = compile_now(constraint, info, vocab_size)
        return compiled[constraint]

    return ready


def row_factory(tokenizer, vocab_size: int, stop_ids):
    """Constraint -> a fresh row matcher over a grammar compiled once."""
    ready = grammar_compiler(tokenizer, vocab_size, stop_ids)
    return lambda constraint: ready(constraint).matcher()


def greedy(
    model, prompt_ids: Sequence[int], row: RowMatcher | None, *, max_tokens: int, stop_ids: frozenset[int]
) -> list[int]:
    cache = {cache_argument(model): DynamicCache(config=model.config)}

    def step(ids: list[int]) -> torch.Tensor:  # [V] logits after `ids`
        return model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1, **cache).logits[0, -1].float()

    out: list[int] = []
    with torch.inference_mode():
        logits = step(list(prompt_ids))
        for _ in range(max_tokens):
            if row is not None:
                row.fill_mask(logits)
            token = int(torch.argmax(logits))
            out.append(token)
            if row is not None:
                row.accept(token)
            if token in stop_ids or (row is not None and row.is_terminated()):
                break
            logits = step([token])
    return out
