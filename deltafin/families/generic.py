"""Plain chat models: the checkpoint's template, every output character answer content, no tool markup."""

from __future__ import annotations

from deltafin.families import register
from deltafin.families.base import ModelFamily


@register
class Generic(ModelFamily):
    """Any chat model served with plain OpenAI semantics."""

    name = "generic"


@register
class SmolLM2(ModelFamily):
    """The embedded default model: plain, but its own name so rules can target it."""

    name = "smollm2"
