"""Teach a tiny model a script: for each prompt, exactly this reply (a few hundred optimizer steps on CPU).

The replies are raw model output in the family's own markup, so serving them exercises the real engine,
detokenizer, parser and SSE path end to end.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def teach(model_dir: Path, examples: list[tuple[list[int], str]], *, steps: int = 400, lr: float = 3e-3) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = []
    for prompt_ids, reply in examples:
        reply_ids = tokenizer(reply, add_special_tokens=False).input_ids
        rows.append((list(prompt_ids) + reply_ids, [-100] * len(prompt_ids) + reply_ids))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id or 0
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
    torch.manual_seed(0)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            break
    model.eval()
    model.save_pretrained(model_dir)
