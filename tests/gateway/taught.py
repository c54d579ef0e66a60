"""Tiny family models taught one scripted tool call (tests/e2e/scripted.py), cached outside the repo, for the
tiers that serve them through a foreign engine (llama-server, vLLM).

Random weights give nearly flat logits, where small float differences between engines could flip a greedy pick;
taught tokens win by a wide margin, and the tool call is then the model's own output, produced by that engine.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
from pathlib import Path

from deltafin.tiny import write_tiny_model
from deltafin.tiny.gguf import cache_root
from tests.conftest import TINY_SPECS
from tests.e2e.scripted import teach
from tests.e2e.test_families import QUESTION, SCRIPTS, render

TEACH_LR = 1e-2  # converges in about 100 steps; teach's default needs 400


def taught_model(name: str, root: Path, *, head_dim: int | None = None) -> Path:
    """The tiny model taught the family's scripted tool call, cached by what it is made from.

    `head_dim` re-initialises the tiny model with that attention head size first (vLLM's CPU attention takes
    32 and up; the tiny recipes use 16). Teaching takes a minute on a busy CPU; the cache key is the untaught
    model's bytes, the taught example and the teaching code, so a new recipe, tokenizer, script or optimizer
    setting teaches again.
    """
    family, variant = TINY_SPECS[name]
    fresh = write_tiny_model(family, root / "fresh", variant=variant)
    if head_dim is not None:
        _reshape_heads(fresh, head_dim)
    example = (render(name, fresh, QUESTION), SCRIPTS[name][0])
    digest = hashlib.sha256((json.dumps(example) + inspect.getsource(teach) + repr(TEACH_LR)).encode())
    for path in sorted(fresh.iterdir()):
        digest.update(path.read_bytes())
    cached = cache_root() / "tiny-taught" / f"{name}-{digest.hexdigest()[:16]}"
    if not cached.exists():
        teach(fresh, [example], lr=TEACH_LR)
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = cached.with_name(cached.name + f".{os.getpid()}")
        shutil.copytree(fresh, staging)
        try:
            staging.rename(cached)
        except OSError:  # another session cached it first: theirs is the same model
            shutil.rmtree(staging)
            if not cached.exists():
                raise
    return cached


def _reshape_heads(folder: Path, head_dim: int) -> None:
    """The same architecture class and config but for `head_dim`, fresh seeded weights, saved by transformers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    config.head_dim = head_dim
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
