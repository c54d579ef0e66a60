"""Which model the local engine loads from a checkpoint folder, and whether it can run it: decided at load.

A multimodal checkpoint whose language model transformers knows is served for text: its language model's
config is taken out of the wrapper's, its weights are read under their prefix, and the other towers are never
loaded (`MULTIMODAL`). Kimi K3 is such a checkpoint (`KimiK3ForConditionalGeneration`, remote code): a MoonViT3d
vision tower and projector beside a Kimi Linear language model (`language_model.model.layers.N...`).

What the engine cannot run fails the load with one line naming the architecture and why (the server stays up
and says so on /health): cache layer kinds it does not batch (`cache_layers.unsupported_layers`), and config
features transformers' class for that model type does not implement (`UNIMPLEMENTED`), which transformers
itself would load without complaint and compute wrongly. K3's language model is such a case: its text config
names `KimiLinearForCausalLM`, but it adds attention residuals, a latent MoE, the SiTU activation, an MLA output
gate and a lower-bounded, full-rank KDA gate (the reference `modeling_kimi_linear.py` of the checkpoint, as
carried by llmcompressor; llama.cpp's `conversion/kimi_k3.py` lists the same five), none of which transformers'
Kimi Linear has.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.core_model_loading import ConversionOps, WeightConverter, WeightRenaming


@dataclass(frozen=True)
class Multimodal:
    """Where a multimodal checkpoint keeps the language model served for text."""

    text_config: str  # key of the language model's config in config.json
    prefix: str  # its weights' name prefix in the checkpoint
    towers: tuple[str, ...]  # weight prefixes of what is not served (never loaded)
    loading: Callable[[], AbstractContextManager[Any]] = nullcontext  # around the load: tensor layouts it differs in


#: config.json model_type -> the layout of that multimodal checkpoint
MULTIMODAL: dict[str, Multimodal] = {}


def _set(key: str) -> Callable[[dict[str, Any]], bool]:
    return lambda config: config.get(key) not in (None, False)


def _linear(key: str) -> Callable[[dict[str, Any]], bool]:
    return lambda config: (config.get("linear_attn_config") or {}).get(key) not in (None, False)


#: model_type -> (test on the raw config, what it turns on) for features the transformers class ignores
UNIMPLEMENTED: dict[str, list[tuple[Callable[[dict[str, Any]], bool], str]]] = {
    "kimi_linear": [
        (_set("attn_res_block_size"), "attention residuals (attn_res_block_size)"),
        (_set("routed_expert_hidden_size"), "a latent MoE (routed_expert_hidden_size)"),
        (lambda c: c.get("hidden_act") == "situ", "the SiTU activation (hidden_act=situ)"),
        (_set("mla_use_output_gate"), "an MLA output gate (mla_use_output_gate)"),
        (_linear("gate_lower_bound"), "a lower-bounded KDA gate (linear_attn_config.gate_lower_bound)"),
        (_linear("use_full_rank_gate"), "a full-rank KDA gate (linear_attn_config.use_full_rank_gate)"),
        (lambda c: c.get("mla_use_nope") is False, "rotary MLA (mla_use_nope=false; transformers' is NoPE only)"),
        (
            lambda c: c.get("moe_router_activation_func", "sigmoid") != "sigmoid",
            "softmax expert routing (moe_router_activation_func)",
        ),
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


class ViewAsParameter(ConversionOps):
    """A weight conversion op: a tensor stored in another view of its parameter's shape (K3's checkpoint keeps a
    KDA layer's `A_log` as [heads], transformers' Kimi Linear as [1, 1, heads, 1]) is viewed as the parameter;
    one of the parameter's shape passes unchanged. Registered only while a K3 checkpoint loads (`k3_views`), so
    saving, which runs the table backwards, never meets it (it has no reverse)."""

    @torch.no_grad()
    def convert(  # type: ignore[override]  # transformers' own ops add keyword arguments the same way
        self,
        input_dict: dict[str, Any],
        source_patterns: list[str],
        target_patterns: list[str],
        model: Any = None,
        full_layer_name: str | None = None,
        **kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        (tensors,) = input_dict.values()
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        shape = model.get_parameter(full_layer_name).shape
        return {target_patterns[0]: tensor.reshape(shape) if tensor.numel() == shape.numel() else tensor}


@contextmanager
def k3_views() -> Iterator[None]:
    """While loading, transformers' Kimi Linear accepts K3's `A_log` layout: its conversion mapping's `A_log`
    rename also views the tensor as the parameter. The mapping is transformers' process-wide table, so it is
    put back afterwards: saving (which reverses the table) and every other load see transformers' own."""
    from transformers import conversion_mapping

    original = conversion_mapping.get_checkpoint_conversion_mapping("kimi_linear") or []
    patched = [
        WeightConverter("self_attn.A_log", "self_attn.forget_gate.A_log", operations=[ViewAsParameter()])
        if isinstance(t, WeightRenaming) and t.source_patterns == [r"self_attn\.A_log"]
        else t
        for t in original
    ]
    conversion_mapping.register_checkpoint_conversion_mapping("kimi_linear", patched, overwrite=True)
    try:
        yield
    finally:
        conversion_mapping.register_checkpoint_conversion_mapping("kimi_linear", original, overwrite=True)
        # registering marks the type user-registered, which would apply the table to remote-code classes too
        conversion_mapping.USER_REGISTERED_MAPPINGS.discard("kimi_linear")


# KimiK3ForConditionalGeneration: vision_tower (MoonViT3d), mm_projector, language_model (Kimi Linear)
MULTIMODAL["kimi_k3"] = Multimodal("text_config", "language_model.", ("vision_tower.", "mm_projector."), k3_views)
