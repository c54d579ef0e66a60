"""Tiny family models taught one scripted tool call (deltafin/tiny/taught.py), cached outside the repo, for the
tiers that serve them through a foreign engine (llama-server, vLLM): the tool call is then the model's own
output, produced by that engine.
"""

from __future__ import annotations

from pathlib import Path

from deltafin.testing import TINY_SPECS
from deltafin.tiny import write_tiny_model
from deltafin.tiny.taught import reshape_heads, taught
from tests.e2e.test_families import QUESTION, SCRIPTS, render

TEACH_LR = 1e-2  # converges in about 100 steps; teach's default needs 400


def taught_model(name: str, root: Path, *, head_dim: int | None = None) -> Path:
    """The tiny model taught the family's scripted tool call (cached by `deltafin.tiny.taught.taught`).

    `head_dim` re-initialises the tiny model with that attention head size first (vLLM's CPU attention takes
    32 and up; the tiny recipes use 16)."""
    family, variant = TINY_SPECS[name]
    fresh = write_tiny_model(family, root / "fresh", variant=variant)
    if head_dim is not None:
        reshape_heads(fresh, head_dim)
    return taught(fresh, [(render(name, fresh, QUESTION), SCRIPTS[name][0])], lr=TEACH_LR)
