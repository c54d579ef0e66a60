"""The real transformers architecture classes, scaled down to a few hundred thousand parameters.

Family modules name one of these in their tiny recipe (`TinyRecipe.model`, looked up in `ARCHITECTURES`);
transformers is imported only when a model is built.
"""

from __future__ import annotations

from typing import Any, Callable

CONTEXT = 4096


def deepseek_v3(vocab: int) -> Any:
    """Kimi K2/K3 are DeepseekV3-style (MLA attention + MoE): the same class, scaled down."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
        max_position_embeddings=CONTEXT, tie_word_embeddings=False,
    )
    return DeepseekV3ForCausalLM(config)


def glm4_moe(vocab: int) -> Any:
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = Glm4MoeConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=CONTEXT, tie_word_embeddings=False,
    )
    return Glm4MoeForCausalLM(config)


def qwen3(vocab: int) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=CONTEXT, tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config)


#: name (a family's `TinyRecipe.model`) -> vocabulary size -> the scaled-down model
ARCHITECTURES: dict[str, Callable[[int], Any]] = {"deepseek_v3": deepseek_v3, "glm4_moe": glm4_moe, "qwen3": qwen3}
