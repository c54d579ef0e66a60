"""Model code of Deltafin's own, for architectures transformers lacks: one module per architecture, written from
the reference modeling code's math and proven against that code (tests), using transformers' cache layer kinds
and experts interface so batching, the prefix cache, the memo, the expert pool and int8 all apply.

    own_model(config, wrapper=...)   the OwnModel that serves a (text) config, or None (transformers' class does)
    ModelSource                      how the engine builds a folder's model (class, config, key renaming)
    OwnModel.refusal(config)         what of the config the own class does not implement (one line), or None

Kimi K3 (`kimi_k3.py`): the language model of a `kimi_k3` checkpoint (`KimiK3ForConditionalGeneration`, its
`text_config` naming `kimi_linear`), and any Kimi Linear config that turns on a K3 feature transformers' Kimi Linear
lacks. A plain Kimi Linear (Kimi-Linear-48B) stays transformers'.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSource:
    """How the engine builds the model of a checkpoint folder: the config object and class (None: transformers'
    Auto class reads the folder), the checkpoint-key renaming (a multimodal checkpoint's prefix), and the key
    prefixes never read (its other towers)."""

    config: Any = None
    model_class: Any = None  # a PreTrainedModel class
    key_mapping: dict[str, str] | None = None
    ignored: tuple[str, ...] = ()
    name: str = ""  # how logs name what is served (own class, or the text model of a multimodal checkpoint)


@dataclass(frozen=True)
class OwnModel:
    name: str  # how logs and errors name it
    module: str  # deltafin.engine.models.<module>: the config and model classes
    config_class: str
    model_class: str
    #: (test on the raw config, what it turns on) for what this class does not implement
    lacks: tuple[tuple[Callable[[dict[str, Any]], bool], str], ...] = ()
    #: config -> what is missing or out of range in it (keys the layers it builds need)
    faults: Callable[[dict[str, Any]], list[str]] = lambda config: []

    def classes(self) -> tuple[type, type]:
        module = importlib.import_module(f"deltafin.engine.models.{self.module}")
        return getattr(module, self.config_class), getattr(module, self.model_class)

    def refusal(self, config: dict[str, Any]) -> str | None:
        faults = self.faults(config)
        if faults:
            return f"its config has {', '.join(faults)}"
        found = [what for test, what in self.lacks if test(config)]
        return f"it uses {', '.join(found)}, which Deltafin's {self.name} does not implement" if found else None


def _set(key: str) -> Callable[[dict[str, Any]], bool]:
    return lambda config: config.get(key) not in (None, False)


def _linear_config(config: dict[str, Any]) -> dict[str, Any]:
    linear = config.get("linear_attn_config")
    return linear if isinstance(linear, dict) else {}


def _linear(key: str) -> Callable[[dict[str, Any]], bool]:
    return lambda config: _linear_config(config).get(key) not in (None, False)


#: what turns a Kimi Linear config into K3's language model (transformers' class would compute it wrongly)
K3_FEATURES: tuple[Callable[[dict[str, Any]], bool], ...] = (
    _set("attn_res_block_size"),
    _set("routed_expert_hidden_size"),
    lambda c: c.get("hidden_act") == "situ",
    _set("mla_use_output_gate"),
    _linear("gate_lower_bound"),
    _linear("use_full_rank_gate"),
    lambda c: c.get("moe_router_activation_func", "sigmoid") != "sigmoid",
)


def _mla_layers(config: dict[str, Any]) -> bool:
    """Some layer is not KDA (the reference builds MLA there)."""
    layers = config.get("num_hidden_layers", 32)
    return len(_linear_config(config).get("kda_layers") or []) < (layers if isinstance(layers, int) else 32)


def _not_nope(config: dict[str, Any]) -> bool:
    return _mla_layers(config) and config.get("mla_use_nope") is not True


def _grouped_kv(config: dict[str, Any]) -> bool:
    heads = config.get("num_attention_heads", 32)
    return _mla_layers(config) and config.get("num_key_value_heads") not in (None, heads)


def _k3_faults(config: dict[str, Any]) -> list[str]:
    """Keys the layers a K3 config builds need (the reference indexes them and fails without), and values no
    model can run with."""
    faults: list[str] = []
    linear = config.get("linear_attn_config")
    if linear is not None:
        kda_keys = ("kda_layers", "full_attn_layers", "head_dim", "num_heads", "short_conv_kernel_size")
        faults += [
            f"no linear_attn_config.{key}"
            for key in kda_keys
            if not isinstance(linear, dict) or linear.get(key) is None
        ]
    if config.get("num_experts") is not None:
        faults += [f"no {key}" for key in ("num_experts_per_token", "moe_intermediate_size") if config.get(key) is None]
        experts, top_k = config.get("num_experts"), config.get("num_experts_per_token")
        if isinstance(experts, int) and isinstance(top_k, int) and not 0 < top_k <= experts:
            faults.append(f"num_experts_per_token={top_k} outside 1..num_experts ({experts})")
    if _mla_layers(config):
        mla_keys = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        faults += [f"no {key}" for key in mla_keys if config.get(key) is None]
    block = config.get("attn_res_block_size")
    if block is not None and (not isinstance(block, int) or block < 1):
        faults.append(f"attn_res_block_size={block!r} (a positive number of layers)")
    return faults


def _unserved_quantization(config: dict[str, Any]) -> bool:
    """A quantization_config naming a format Deltafin does not serve in its own form (those it serves, the
    published MXFP4 / int4 / FP8 blocks, are read by deltafin.engine.quant.formats for every model class)."""
    if config.get("quantization_config") is None:
        return False
    from deltafin.engine.quant.formats import UnsupportedQuantization, read

    try:
        read({"quantization_config": config["quantization_config"]})
    except UnsupportedQuantization:
        return True
    return False


def _unknown_activation(config: dict[str, Any]) -> bool:
    from transformers.activations import ACT2FN

    act = config.get("hidden_act", "silu")
    return act != "situ" and act not in ACT2FN


KIMI_K3 = OwnModel(
    name="Kimi K3",
    module="kimi_k3",
    config_class="KimiK3Config",
    model_class="KimiK3ForCausalLM",
    lacks=(
        (_not_nope, "rotary MLA (mla_use_nope is not true; the reference asserts NoPE)"),
        (_grouped_kv, "MLA with fewer key-value heads than heads (num_key_value_heads)"),
        (
            lambda c: c.get("moe_router_activation_func", "sigmoid") not in ("sigmoid", "softmax"),
            "an expert router activation other than sigmoid or softmax (moe_router_activation_func)",
        ),
        (_unknown_activation, "an unknown activation (hidden_act)"),
        (_unserved_quantization, "quantized weights in a format not served (quantization_config)"),
    ),
    faults=_k3_faults,
)


def own_model(config: dict[str, Any], *, wrapper: str | None = None) -> OwnModel | None:
    """The own model class serving `config` (a language model's config; `wrapper`: the model_type of the
    multimodal checkpoint around it, if any), or None where transformers' class serves it."""
    if wrapper == "kimi_k3":
        return KIMI_K3
    if config.get("model_type") == "kimi_linear" and any(test(config) for test in K3_FEATURES):
        return KIMI_K3
    return None
