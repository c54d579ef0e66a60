"""A tiny Kimi K3 checkpoint in the real one's multimodal layout, around a tiny Kimi Linear language model.

    python -m deltafin.tiny --family kimi_k3 --out /tmp/k3 --multimodal

The real K3 folder is `KimiK3ForConditionalGeneration` (model_type `kimi_k3`, remote code): config.json holds the
language model's config as `text_config` (a Kimi Linear in the checkpoint's own schema: `linear_attn_config`
with 1-indexed `kda_layers` / `full_attn_layers`) beside a `vision_config`, and the weights are the reference
model's module names: `language_model.model.layers.N...` (separate q/k/v short convolutions, experts
`block_sparse_moe.experts.E.w1/w2/w3`, dense layers' `mlp`, a KDA layer's `A_log` of shape [heads]),
`language_model.lm_head`, `vision_tower.*` (MoonViT3d) and `mm_projector.*`. The tiny vision tower is a few
random tensors under those prefixes: Deltafin serves the language model for text and never loads them.
No remote code is written (the folder is loaded by Deltafin, not by `trust_remote_code`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

#: files of the text model's folder that the multimodal one keeps as they are
_KEPT = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "deltafin_tiny.json",
)
#: transformers' Kimi Linear config keys that the checkpoint's own schema spells otherwise
_LINEAR_KEYS = ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim")


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """transformers' saved Kimi Linear config -> the checkpoint's own `text_config` schema (which transformers'
    `KimiLinearConfig` reads too)."""
    out = {k: v for k, v in config.items() if k not in _LINEAR_KEYS}
    layers = config["layer_types"]
    out["linear_attn_config"] = {
        "kda_layers": [i + 1 for i, kind in enumerate(layers) if kind == "linear_attention"],
        "full_attn_layers": [i + 1 for i, kind in enumerate(layers) if kind == "full_attention"],
        "head_dim": config["linear_head_dim"],
        "num_heads": config["linear_num_heads"],
        "short_conv_kernel_size": config["linear_conv_kernel_dim"],
    }
    dense = config["mlp_layer_types"]
    out["first_k_dense_replace"] = next((i for i, kind in enumerate(dense) if kind != "dense"), len(dense))
    out["moe_layer_freq"] = 1
    out["mla_use_nope"] = True  # transformers' Kimi Linear is NoPE, as every released checkpoint
    return out


def language_model_weights(tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """transformers' saved Kimi Linear weights -> the reference K3 module names and shapes, under
    `language_model.`. transformers saves the original Kimi Linear names already, but a dense layer's MLP under
    `block_sparse_moe.` (its load rename run backwards) and `A_log` as [1, 1, heads, 1]."""
    dense = {i for i, kind in enumerate(config["mlp_layer_types"]) if kind == "dense"}
    out = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) in dense and parts[3] == "block_sparse_moe":
            parts[3] = "mlp"
        if parts[-1] == "A_log":
            tensor = tensor.reshape(-1)
        out["language_model." + ".".join(parts)] = tensor.contiguous()
    return out


def vision_weights(text_hidden: int, seed: int = 0) -> dict[str, Any]:
    """A token vision tower and projector under the reference module names (never loaded by Deltafin)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    shapes = {
        "vision_tower.patch_embed.proj.weight": (16, 3, 2, 2),
        "vision_tower.encoder.final_layernorm.weight": (16,),
        "mm_projector.proj.0.weight": (64, 64),
        "mm_projector.proj.2.weight": (text_hidden, 64),
        "mm_projector.post_norm.weight": (text_hidden,),
    }
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def write_k3_checkpoint(text_model: Path, out: Path) -> Path:
    """Writes `out`: the tiny Kimi Linear folder `text_model` (written by `deltafin.tiny` for kimi_k3) as the
    language model of a K3-layout checkpoint."""
    from safetensors.torch import load_file, save_file

    config = json.loads((text_model / "config.json").read_text())
    if config.get("model_type") != "kimi_linear":
        raise ValueError(f"{text_model} is not a Kimi Linear model folder")
    out.mkdir(parents=True, exist_ok=True)
    tensors = language_model_weights(load_file(str(text_model / "model.safetensors")), config)
    tensors.update(vision_weights(config["hidden_size"]))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    wrapper = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text_config(config),
        "vision_config": {
            "patch_size": 2,
            "vt_hidden_size": 16,
            "vt_num_hidden_layers": 0,
            "vt_num_attention_heads": 2,
            "vt_intermediate_size": 32,
            "mm_hidden_size": 16,
            "merge_kernel_size": [2, 2],
            "mm_projector_type": "patchmergerv2",
            "text_hidden_size": config["hidden_size"],
        },
        "pad_token_id": config.get("pad_token_id"),
        "eos_token_id": config.get("eos_token_id"),
        "dtype": config.get("dtype", "float32"),
    }
    (out / "config.json").write_text(json.dumps(wrapper, indent=2))
    for name in _KEPT:
        if (text_model / name).exists():
            shutil.copy2(text_model / name, out / name)
    return out
