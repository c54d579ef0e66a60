"""/v1/models: the served models (and their aliases, which name the same weights; an alias that is a pattern of
names, `claude-*`, is listed by none)."""

from __future__ import annotations

from typing import Any

from deltafin.config.models import is_pattern
from deltafin.errors import ModelNotFoundError, quoted_name
from deltafin.serving.context import ServingContext


def _card(ctx: ServingContext, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "deltafin",
        "root": ctx.model_name,
        "max_model_len": ctx.engine.context_length,
        # what a request that leaves a sampling field out is served with (model.sampling, generation_config.json)
        "sampling_defaults": ctx.sampling_defaults.values(),
    }


def list_models(contexts: list[ServingContext]) -> dict[str, Any]:
    """Every loaded model's card, and one per alias, the main model first."""
    cards = [
        _card(ctx, name)
        for ctx in contexts
        for name in (ctx.model_name, *ctx.config.model.aliases)
        if not is_pattern(name)
    ]
    return {"object": "list", "data": cards}


def get_model(ctx: ServingContext, name: str) -> dict[str, Any]:
    if not ctx.serves(name):
        raise ModelNotFoundError(f"The model `{quoted_name(name)}` does not exist.", param="model")
    return _card(ctx, name)
