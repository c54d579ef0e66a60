"""A hand-written greedy decode loop with a RowConstraint, the way the batched sampler applies one: mask after
penalties/bias (none here), before the (greedy) choice; accept; stop on a stop token or a terminated grammar."""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache

from deltafin.engine.generator import cache_argument, decode_one_token, prefill
from deltafin.engine.constraint import RowConstraint


def greedy(model, prompt_ids: Sequence[int], row: RowConstraint | None, *, max_tokens: int, stop_ids: frozenset[int]) -> list[int]:
    cache = {cache_argument(model): DynamicCache(config=model.config)}
    out: list[int] = []
    with torch.inference_mode():
        logits = prefill(model, torch.tensor([list(prompt_ids)]), cache)[-1].float()
        for _ in range(max_tokens):
            if row is not None:
                row.fill_mask(logits)
            token = int(torch.argmax(logits))
            out.append(token)
            if row is not None:
                row.accept(token)
            if token in stop_ids or (row is not None and row.is_terminated()):
                break
            logits = decode_one_token(model, torch.tensor([[token]]), cache).float()
    return out
