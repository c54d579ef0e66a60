"""The real transformers architecture classes, scaled down to a few hundred thousand parameters.

Family modules name one of these in their tiny recipe (`TinyRecipe.model`, looked up in `ARCHITECTURES`);
transformers is imported only when a model is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CONTEXT = 4096


def deepseek_v3(vocab: int) -> Any:
    """Kimi K2 is DeepseekV3-style (MLA attention + MoE): the same class, scaled down."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
    )
    return DeepseekV3ForCausalLM(config)


def glm4_moe(vocab: int) -> Any:
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = Glm4MoeConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
    )
    return Glm4MoeForCausalLM(config)


def qwen3(vocab: int) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config)


#: Qwen3-Next's pattern, scaled down: three linear-attention layers to one full-attention layer, with a linear
#: layer after the attention one (its state then depends on what attention computed)
_HYBRID_LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
#: Kimi Linear's, in two layers: a KDA layer first, as in the real one, then MLA
_KIMI_LAYERS = ["linear_attention", "full_attention"]


def kimi_linear(vocab: int) -> Any:
    """transformers' Kimi Linear (KDA linear attention + NoPE MLA full attention + MoE, Kimi-Linear-48B's
    architecture): its layer kinds and MoE shape (first layer dense, then routed experts and a shared one)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    config = KimiLinearConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=len(_KIMI_LAYERS),
        layer_types=list(_KIMI_LAYERS),
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        linear_head_dim=16,
        linear_num_heads=4,
        linear_conv_kernel_dim=4,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,  # the defaults are ids of the real vocabulary
    )
    return KimiLinearForCausalLM(config)


def qwen3_next(vocab: int) -> Any:
    """Qwen3-Next (gated delta net linear attention + gated full attention + MoE): a second hybrid family,
    so the engine's hybrid caches are not shaped after one model."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(_HYBRID_LAYERS),
        layer_types=list(_HYBRID_LAYERS),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
    )
    return Qwen3NextForCausalLM(config)


def falcon_h1(vocab: int) -> Any:
    """Falcon-H1 (attention and a Mamba-2 mixer side by side in every layer): the third kind of hybrid cache
    layer, KV and recurrent state in one layer object."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    config = FalconH1Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # type: ignore[call-arg]  # a config attribute its __init__ takes through **kwargs
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_chunk_size=16,
        max_position_embeddings=CONTEXT,
    )
    return FalconH1ForCausalLM(config)


def kimi_k3(vocab: int) -> Any:
    """Kimi K3's language model, every released feature on (Deltafin's own class: transformers has none)."""
    from deltafin.tiny.kimi_k3 import kimi_k3 as build

    return build(vocab)


#: name (a family's `TinyRecipe.model`) -> vocabulary size -> the scaled-down model
ARCHITECTURES: dict[str, Callable[[int], Any]] = {
    "kimi_k3": kimi_k3,
    "deepseek_v3": deepseek_v3,
    "glm4_moe": glm4_moe,
    "qwen3": qwen3,
    "kimi_linear": kimi_linear,
    "qwen3_next": qwen3_next,
    "falcon_h1": falcon_h1,
}


def _save_k3(model: Any, folder: Any) -> None:
    from deltafin.tiny.kimi_k3 import save_k3

    save_k3(model, folder)


#: name -> how the model is written, where that is not transformers' `save_pretrained` (a released layout)
SAVERS: dict[str, Callable[[Any, Any], None]] = {"kimi_k3": _save_k3}
