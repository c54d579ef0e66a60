"""Write a family's tiny model: architecture, random weights, tokenizer with its special tokens, chat template."""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any


def write_tiny_model(
    family: str,
    out: Path,
    *,
    variant: str | None = None,
    seed: int = 0,
    context: int | None = None,
    architecture: Callable[[int], Any] | None = None,
    save: Callable[[Any, Path], None] | None = None,
) -> Path:
    """Write config, safetensors weights, tokenizer (with chat template) and generation config to `out`.
    `context`: the model's max_position_embeddings (its context length), e.g. for prompts as long as an agent's.
    `architecture` (vocabulary size -> model) replaces the family's architecture: e.g. a tiny Qwen3-Next with
    Qwen3's tokens and template, to run another architecture through a family's format. `save` (model, folder)
    replaces `save_pretrained` (deltafin.tiny.moe: MoEs of any size, streamed to disk)."""
    import torch

    from deltafin.families import get_family
    from deltafin.tiny.architectures import ARCHITECTURES, SAVERS
    from deltafin.tiny.tokenizer import train_tokenizer

    spec = get_family(family)
    variant = spec.variant(variant)
    recipe = spec.tiny_recipe(variant)
    if recipe is None:
        raise ValueError(f"family {family!r} has no tiny model")
    torch.manual_seed(seed)
    tokenizer = train_tokenizer(recipe.special_tokens)
    tokenizer.eos_token = recipe.stop_tokens[0]
    last = recipe.special_tokens[-1]
    tokenizer.pad_token = last if "pad" in last else recipe.stop_tokens[0]
    if recipe.template:
        text = resources.files("deltafin.tiny").joinpath("templates", recipe.template).read_text()
        tokenizer.chat_template = recipe.template_prefix + text
    model = (architecture or ARCHITECTURES[recipe.model])(len(tokenizer))
    if context is not None:  # rotary positions: a longer context is only this number
        model.config.max_position_embeddings = context
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in recipe.stop_tokens]
    model.config.eos_token_id = stop_ids
    model.generation_config.eos_token_id = stop_ids
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    if save is None and architecture is None:
        save = SAVERS.get(recipe.model)
    (save or (lambda m, folder: m.save_pretrained(folder)))(model, out)
    tokenizer.save_pretrained(out)
    (out / "deltafin_tiny.json").write_text(json.dumps({"family": family, "variant": variant, "seed": seed}))
    return out
