"""The model side of the pool: find the experts modules, and load a model with only its dense weights.

An experts module is any module built by transformers' `@use_experts_implementation` (its forward dispatches
on `config._experts_implementation`), holding `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]; its router
is the `gate` of the MoE block that holds it (DeepseekV3, Kimi Linear, Glm4Moe, Qwen3-MoE and Mixtral all
call `self.gate(hidden) -> (logits, weights, indices)` then `self.experts(hidden, indices, weights)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deltafin.engine.models import ModelSource
from deltafin.engine.quant.formats import PublishedFormat
from deltafin.engine.quant.formats.linear import packed_linear
from deltafin.engine.quant.formats.tensors import check_shape


class NotPoolable(ValueError):
    """The model cannot be served with an expert pool (the message says why)."""


@dataclass(frozen=True)
class ModelShape:
    """What sizing the pool needs to know about a MoE, read from its config without its weights."""

    layers: int  # experts modules (MoE layers)
    experts: int  # routed experts per layer
    top_k: int  # experts each token is routed to
    gate_up_shape: tuple[int, int]  # [2I, H]
    down_shape: tuple[int, int]  # [H, I]


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> experts module, in model order; NotPoolable for experts the pool cannot compute."""
    found = {}
    for name, module in model.named_modules():
        if not hasattr(module, "_is_expert_parallel") or not hasattr(module, "gate_up_proj"):
            continue  # not built by @use_experts_implementation with fused gate/up weights
        layout = {
            "has_gate": True,
            "has_bias": False,
            "is_transposed": False,
            "is_concatenated": True,
            "has_post_expert_norm": False,
        }
        wrong = [key for key, value in layout.items() if getattr(module, key, value) != value]
        if wrong or getattr(module.gate_up_proj, "ndim", 0) != 3:
            raise NotPoolable(
                f"{name} ({type(module).__name__}): experts with {', '.join(wrong) or 'this layout'} "
                "are not supported by the expert pool"
            )
        found[name] = module
    return found


def router_of(model: nn.Module, experts_name: str) -> Any | None:
    """The router beside an experts module (the MoE block's `gate`), or None."""
    parent_name = experts_name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    gate = getattr(parent, "gate", None)
    return gate if isinstance(gate, nn.Module) else None


def model_class(config: Any, folder: Path, trust_remote_code: bool) -> Any:
    """The transformers class (a PreTrainedModel subclass) that builds `config`."""
    from transformers import AutoModelForCausalLM

    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], str(folder))
    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise NotPoolable(f"{type(config).__name__} has no causal-LM class in transformers") from None


@dataclass(frozen=True)
class CheckpointView:
    """How a folder's weights are read: how its model is built (`ModelSource`: an own class, a multimodal
    checkpoint's language model under its key renaming; None: transformers' Auto classes on the folder), and the
    published quantized format they are stored in (None: float)."""

    source: ModelSource | None = None
    published: PublishedFormat | None = None


def meta_model(
    folder: Path, *, dtype: torch.dtype, trust_remote_code: bool, source: ModelSource | None = None
) -> tuple[Any, Any, nn.Module]:
    """(config, class, the model built on the meta device: shapes only, no memory). `source`: the config and
    class to build (None: read from the folder by transformers' Auto classes). The config never carries a
    quantization config: the weights are read here, never by transformers' quantizers."""
    from transformers import AutoConfig

    config = source.config if source is not None and source.config is not None else None
    if config is None:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    cls: Any = source.model_class if source is not None else None
    if cls is None:
        cls = model_class(config, folder, trust_remote_code)
    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype)
    return config, cls, model


def model_shape(model: Any, experts: dict[str, Any]) -> ModelShape:
    if not experts:
        raise NotPoolable("the model has no routed experts")
    first_name, first = next(iter(experts.items()))
    router = router_of(model, first_name)
    top_k = getattr(router, "top_k", None) or getattr(model.config, "num_experts_per_tok", None)
    if not top_k:
        raise NotPoolable(f"{first_name}: cannot tell how many experts a token is routed to")
    count, gate_up_rows, hidden = first.gate_up_proj.shape
    _, down_rows, down_cols = first.down_proj.shape
    return ModelShape(
        len(experts), int(count), int(top_k), (int(gate_up_rows), int(hidden)), (int(down_rows), int(down_cols))
    )


def load_dense(
    folder: Path, *, dtype: torch.dtype, trust_remote_code: bool, view: CheckpointView | None = None
) -> tuple[nn.Module, dict[str, nn.Module], Any, ModelShape | None]:
    """The model with every weight loaded except the routed experts, which hold no memory; its experts
    modules; the index of where the experts lie in the checkpoint (`checkpoint.ExpertIndex`); its shape (None:
    a model without routed experts, possible for a published quantized checkpoint).

    transformers' own loader runs (`from_pretrained`, with its renamings and conversions for the dense
    weights) on a state dict of lazy slices of the dense float tensors, plus one zero-stride tensor of the
    fused shape for each expert parameter: it is accepted as loaded, so nothing allocates or initializes
    [E, 2I, H] floats; the pool's forward never reads it, and it is then replaced by an empty tensor. A
    quantized dense Linear gets such a placeholder weight too, then becomes the module of its format over its
    stored tensors (`deltafin.engine.quant.formats.linear`). The view's source as for `meta_model`, its key
    renaming and ignored prefixes applied to the checkpoint's keys."""
    from safetensors import safe_open
    from transformers import GenerationConfig

    from deltafin.engine.experts.checkpoint import build_index

    view = view or CheckpointView()
    source = view.source
    config, cls, meta = meta_model(folder, dtype=dtype, trust_remote_code=trust_remote_code, source=source)
    meta_experts = experts_modules(meta)
    shape = model_shape(meta, meta_experts) if meta_experts or view.published is None else None
    key_mapping = source.key_mapping if source is not None else None
    index = build_index(
        folder,
        meta,
        meta_experts,
        key_mapping=key_mapping,
        ignored=source.ignored if source else (),
        published=view.published,
    )
    handles = {path: safe_open(str(path), framework="pt", device="cpu") for path in index.files}
    try:
        located = {}
        for handle in handles.values():
            located.update(dict.fromkeys(handle.keys(), handle))

        def tensor(key: str) -> torch.Tensor:
            return located[key].get_tensor(key)

        state: dict[str, Any] = {key: located[key].get_slice(key) for key in index.dense_keys}
        for name in index.layers:
            module = meta.get_submodule(name)
            for part in ("gate_up_proj", "down_proj"):
                state[f"{name}.{part}"] = torch.zeros((), dtype=dtype).expand(getattr(module, part).shape)
        for name, spec in index.dense_packed.items():
            state[f"{name}.weight"] = torch.zeros((), dtype=dtype).expand(spec.out_features, spec.in_features)
        model = cls.from_pretrained(None, config=config, state_dict=state, dtype=dtype, key_mapping=key_mapping)
        for spec, _entry in index.shape_checks:
            check_shape(spec, tensor(spec.keys["shape"]))
        for name, spec in index.dense_packed.items():
            if "shape" in spec.keys:
                check_shape(spec, tensor(spec.keys["shape"]))
            _swap(model, name, packed_linear(spec, tensor(spec.keys["codes"]), tensor(spec.keys["scales"])))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    experts = experts_modules(model)
    for module in experts.values():
        for part in ("gate_up_proj", "down_proj"):
            setattr(module, part, nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False))
    if (folder / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model, experts, index, shape


def _swap(model: nn.Module, name: str, new: Any) -> None:
    """Replace the Linear `name` of `model` with `new` (a packed module), keeping its bias. A module that is
    no Linear reads its weight itself rather than calling a projection (K3's attention-residual scores): it
    gets the packed weight dequantized by the format's definition (`new.dequantized()`), once, at load."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    if not isinstance(old, nn.Linear):
        weight = new.dequantized().to(old.weight.dtype).reshape(old.weight.shape)
        old.weight = nn.Parameter(weight, requires_grad=False)
        return
    if getattr(old, "bias", None) is not None:
        new.bias = nn.Parameter(old.bias.detach().float(), requires_grad=False)
    setattr(parent, child, new)
