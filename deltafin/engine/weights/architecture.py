"""Which model the local engine loads from a checkpoint folder, and whether it can run it: decided at load.

A multimodal checkpoint is served for text: its language model's config is taken out of the wrapper's, its
weights are read under their prefix, and the other towers are never loaded (`MULTIMODAL`). Kimi K3 is such a
checkpoint (`KimiK3ForConditionalGeneration`, remote code): a MoonViT3d vision tower and projector beside its
language model (`language_model.model.layers.N...`), a Kimi Linear with attention residuals, a latent MoE, SiTU,
an MLA output gate and a bounded full-rank KDA gate, which transformers' Kimi Linear lacks: Deltafin's own class
serves it (`deltafin.engine.models`, asked first: `model_source`).

What the engine cannot run fails the load with one line naming the architecture and why (the server stays up
and says so on /health): cache layer kinds it does not batch (`cache_layers.unsupported_layers`), config features
transformers' class for that model type does not implement (`UNIMPLEMENTED`), which transformers itself would
load without complaint and compute wrongly, and what an own model class does not implement (`OwnModel.refusal`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from deltafin.engine.models import ModelSource, own_model


@dataclass(frozen=True)
class Multimodal:
    """Where a multimodal checkpoint keeps the language model served for text."""

    text_config: str  # key of the language model's config in config.json
    prefix: str  # its weights' name prefix in the checkpoint
    towers: tuple[str, ...]  # weight prefixes of what is not served (never loaded)


#: config.json model_type -> the layout of that multimodal checkpoint
MULTIMODAL: dict[str, Multimodal] = {}


#: model_type -> (test on the raw config, what it turns on) for features the transformers class ignores (the Kimi
#: Linear configs with K3's features are Deltafin's own class's: deltafin.engine.models)
UNIMPLEMENTED: dict[str, list[tuple[Callable[[dict[str, Any]], bool], str]]] = {
    "kimi_linear": [
        (lambda c: c.get("mla_use_nope") is False, "rotary MLA (mla_use_nope=false; transformers' is NoPE only)"),
    ],
}


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def name(config: dict[str, Any]) -> str:
    """How the load error names an architecture: its class and model type, as config.json gives them."""
    architecture = (config.get("architectures") or ["?"])[0]
    return f"{architecture} ({config.get('model_type', '?')})"


def text_model(config: dict[str, Any]) -> tuple[dict[str, Any], Multimodal] | None:
    """The language model's config and the layout, for a multimodal checkpoint served for text (else None)."""
    layout = MULTIMODAL.get(config.get("model_type", ""))
    if layout is None:
        return None
    text = config.get(layout.text_config)
    if not isinstance(text, dict) or "model_type" not in text:
        raise ValueError(f"{name(config)} has no {layout.text_config} naming its language model's model_type")
    return text, layout


def unimplemented(config: dict[str, Any]) -> str | None:
    """Features the config turns on that transformers' class for its model type does not implement."""
    found = [what for test, what in UNIMPLEMENTED.get(config.get("model_type", ""), []) if test(config)]
    if not found:
        return None
    return f"it uses {', '.join(found)}, which transformers' class for {config['model_type']} does not implement"


def key_mapping(layout: Multimodal) -> dict[str, str]:
    """`from_pretrained(key_mapping=...)`: the language model's weights under their own names."""
    return {f"^{re.escape(layout.prefix)}": ""}


def model_source(raw: dict[str, Any]) -> tuple[ModelSource | None, str | None]:
    """(how to build the model of a folder whose config.json is `raw`, or None for transformers' Auto classes on
    the folder; why the engine cannot run it, or None). ValueError for a multimodal config without its language
    model's. Nothing but the config is read."""
    from transformers import AutoConfig

    text = text_model(raw)
    config = text[0] if text is not None else raw
    own = own_model(config, wrapper=raw.get("model_type") if text is not None else None)
    if own is not None:
        # a multimodal checkpoint may state its quantization at the top level only: it applies to the text model too
        quantized = {"quantization_config": raw["quantization_config"]} if "quantization_config" in raw else {}
        problem = own.refusal({**quantized, **config} if text is not None else config)
        if problem is not None:
            return None, problem
        config_class, model_class = own.classes()
        source = ModelSource(config_class(**config), model_class, name=own.name)
    elif text is not None:
        problem = unimplemented(config)
        if problem is not None:
            return None, problem
        source = ModelSource(AutoConfig.for_model(**config), name=config["model_type"])
    else:
        return None, unimplemented(config)
    if text is not None:
        layout = text[1]
        source = replace(source, key_mapping=key_mapping(layout), ignored=layout.towers)
    return source, None


# KimiK3ForConditionalGeneration: vision_tower (MoonViT3d), mm_projector, language_model (Kimi Linear)
MULTIMODAL["kimi_k3"] = Multimodal("text_config", "language_model.", ("vision_tower.", "mm_projector."))
