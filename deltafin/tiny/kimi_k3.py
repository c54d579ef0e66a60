"""A tiny Kimi K3 with every feature of the released language model on, written in the released checkpoint's
layout.

    python -m deltafin.tiny --family kimi_k3 --out /tmp/k3

The released K3 folder is `KimiK3ForConditionalGeneration` (model_type `kimi_k3`): config.json holds the language
model's config as `text_config` (a Kimi Linear in the checkpoint's own schema: `linear_attn_config` with 1-based
`kda_layers` / `full_attn_layers`, K3's keys beside it) next to a `vision_config`, and the weights carry the
reference model's names under `language_model.` (separate q/k/v short convolutions, `A_log` [heads], routed
experts per expert as `block_sparse_moe.experts.E.w1/w2/w3`, dense layers' `mlp.`, the attention residuals'
`*_res_norm` / `*_res_proj`), beside `vision_tower.*` (MoonViT3d) and `mm_projector.*`, which Deltafin never loads
(a few random tensors here). The language model is Deltafin's own K3 class (deltafin.engine.models.kimi_k3), its
names and shapes the reference class's (tests check them against the reference code), with K3's shape scaled down:
KDA layers around an MLA layer (and a KDA layer after it), a dense first layer then latent MoE layers with shared
experts, attention-residual blocks of two layers, SiTU, the MLA output gate, the bounded full-rank KDA gate.
Its weights are drawn at a scale that gives decided logits (every feature moves them), not the training init.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: the tiny language model's text_config (the released K3's keys; the shapes scaled down). The KDA heads are as
#: many as the MLA ones, and as wide: llama.cpp's converter assumes both
TEXT_CONFIG: dict[str, Any] = {
    "model_type": "kimi_linear",
    "architectures": ["KimiLinearForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "rms_norm_eps": 1e-5,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 2,
    "moe_intermediate_size": 32,  # expert widths multiples of 32, as the released MXFP4 experts' groups need
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_expert_hidden_size": 32,
    "latent_moe_use_norm": True,
    "attn_res_block_size": 2,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5],
        "full_attn_layers": [4],
        "head_dim": 16,
        "num_heads": 4,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    },
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "pad_token_id": None,  # the reference's defaults (0, 1, 2) are ids of the real vocabulary
    "bos_token_id": None,
}
CONTEXT = 4096
PREFIX = "language_model."
#: the vision tower and projector, under the reference's module names, never loaded by Deltafin
_VISION = {
    "vision_tower.patch_embed.proj.weight": (16, 3, 2, 2),
    "vision_tower.encoder.final_layernorm.weight": (16,),
    "mm_projector.proj.0.weight": (64, 64),
    "mm_projector.proj.2.weight": (64, 64),
    "mm_projector.post_norm.weight": (64,),
}


def kimi_k3(vocab: int, **text: Any) -> Any:
    """The tiny K3 language model (Deltafin's class), seeded from torch's global generator; `text` overrides
    TEXT_CONFIG keys (a test turning a feature off)."""
    import torch

    from deltafin.engine.models.kimi_k3 import KimiK3Config, KimiK3ForCausalLM

    config = KimiK3Config(**{**TEXT_CONFIG, **text, "vocab_size": vocab, "max_position_embeddings": CONTEXT})
    model = KimiK3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(_draw(name, tensor))
    return model


def _draw(name: str, tensor: Any) -> Any:
    import torch

    if name.endswith("A_log"):
        return torch.empty_like(tensor).uniform_(1, 16).log()
    if name.endswith("dt_bias"):
        return torch.randn_like(tensor) * 0.5
    if name.endswith("e_score_correction_bias"):
        return torch.randn_like(tensor) * 0.1
    if "norm" in name:
        return 1 + 0.1 * torch.randn_like(tensor)
    return torch.randn_like(tensor) * (0.5 / tensor.shape[-1] ** 0.5)


def text_config(config: Any) -> dict[str, Any]:
    """The model's config as the checkpoint's `text_config` (the reference's keys, no transformers internals)."""
    from deltafin.engine.models.kimi_k3 import KimiK3Config

    keys = [key for key in KimiK3Config.__annotations__ if key != "layer_types"]
    out: dict[str, Any] = {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"]}
    out.update({key: getattr(config, key) for key in keys})
    out["num_nextn_predict_layers"] = 0
    return out


def checkpoint_tensors(model: Any) -> dict[str, Any]:
    """The model's weights under the released checkpoint's names (`language_model.` prefix, experts per expert)."""
    out = {}
    for name, tensor in model.state_dict().items():
        module, _, part = name.rpartition(".")
        if module.endswith(".experts") and part in ("gate_up_proj", "down_proj"):
            for expert, weight in enumerate(tensor):
                if part == "down_proj":
                    out[f"{PREFIX}{module}.{expert}.w2.weight"] = weight.contiguous()
                else:
                    gate, up = weight.chunk(2, dim=0)
                    out[f"{PREFIX}{module}.{expert}.w1.weight"] = gate.contiguous()
                    out[f"{PREFIX}{module}.{expert}.w3.weight"] = up.contiguous()
        else:
            out[PREFIX + name] = tensor.contiguous()
    return out


def save_k3(model: Any, out: Path) -> None:
    """Write `model` to `out` as a K3 checkpoint: config.json (the wrapper around `text_config`), one
    safetensors file (language model and vision tower), generation_config.json."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    tensors = checkpoint_tensors(model)
    tensors.update({name: torch.randn(shape, generator=generator) for name, shape in _VISION.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    text = text_config(model.config)
    # one id each, as the released config has them (llama.cpp's converter writes them as single ids); the
    # generation config keeps the list of stop ids
    eos = text["eos_token_id"]
    text["eos_token_id"] = eos[0] if isinstance(eos, list) else eos
    text["pad_token_id"] = model.generation_config.pad_token_id
    wrapper = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text,
        "vision_config": {
            "patch_size": 2,
            "vt_hidden_size": 16,
            "vt_num_hidden_layers": 0,
            "vt_num_attention_heads": 2,
            "vt_intermediate_size": 32,
            "mm_hidden_size": 16,
            "merge_kernel_size": [2, 2],
            "mm_projector_type": "patchmergerv2",
            "text_hidden_size": text["hidden_size"],
        },
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(wrapper, indent=2))
    model.generation_config.save_pretrained(out)
