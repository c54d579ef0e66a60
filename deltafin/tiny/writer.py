"""Write a family's tiny model: architecture, random weights, tokenizer with its special tokens, chat template."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any, Callable


def write_tiny_model(
    family: str,
    out: Path,
    *,
    variant: str | None = None,
    seed: int = 0,
    build: Callable[[int], Any] | None = None,
    save: Callable[[Any, Path], None] | None = None,
) -> Path:
    """Write config, safetensors weights, tokenizer (with chat template) and generation config to `out`.
    `build` (vocabulary size -> model) and `save` (model, folder) replace the family's tiny model and
    `save_pretrained` (deltafin.tiny.moe: MoEs of any size with the family's tokenizer and format)."""
    import torch

    from deltafin.families import get_family
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
    model = (build or recipe.model)(len(tokenizer))
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in recipe.stop_tokens]
    model.config.eos_token_id = stop_ids
    model.generation_config.eos_token_id = stop_ids
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    (save or (lambda m, folder: m.save_pretrained(folder)))(model, out)
    tokenizer.save_pretrained(out)
    (out / "deltafin_tiny.json").write_text(json.dumps({"family": family, "variant": variant, "seed": seed}))
    return out
