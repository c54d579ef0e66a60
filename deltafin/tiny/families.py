"""Per-family recipe of a tiny model: architecture config, special tokens, chat template, stop tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import torch

from deltafin.tiny.tokenizer import train_tokenizer

CONTEXT = 4096


def _deepseek_v3(vocab: int) -> Any:
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


def _glm4_moe(vocab: int) -> Any:
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = Glm4MoeConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=CONTEXT, tie_word_embeddings=False,
    )
    return Glm4MoeForCausalLM(config)


@dataclass(frozen=True)
class TinyFamily:
    model: Callable[[int], Any]
    special_tokens: list[str]
    stop_tokens: list[str]
    template: str | None  # None: Deltafin renders the prompt itself (Kimi K3's XTML)
    template_prefix: str = ""


_K3_TOKENS = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|pad|>"]
_K2_TOKENS = [
    "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_section_begin|>",
    "<|tool_call_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    "<think>", "</think>", "<|pad|>",
]
_GLM_TOKENS = [
    "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
    "</arg_value>", "<tool_response>", "</tool_response>",
]

FAMILIES: dict[str, TinyFamily] = {
    "kimi_k3": TinyFamily(_deepseek_v3, _K3_TOKENS, ["<|end_of_msg|>"], None),
    "kimi_k2": TinyFamily(_deepseek_v3, _K2_TOKENS, ["<|im_end|>"], "kimi_k2.jinja"),
    "glm45": TinyFamily(_glm4_moe, _GLM_TOKENS, ["<|endoftext|>", "<|user|>", "<|observation|>"], "glm.jinja",
                        "{%- set glm47 = false -%}"),
    "glm47": TinyFamily(_glm4_moe, _GLM_TOKENS, ["<|endoftext|>", "<|user|>", "<|observation|>"], "glm.jinja",
                        "{%- set glm47 = true -%}"),
}


def write_tiny_model(family: str, out: Path, *, seed: int = 0) -> Path:
    """Write config, safetensors weights, tokenizer (with chat template) and generation config to `out`."""
    spec = FAMILIES[family]
    torch.manual_seed(seed)
    tokenizer = train_tokenizer(spec.special_tokens)
    tokenizer.eos_token = spec.stop_tokens[0]
    tokenizer.pad_token = spec.special_tokens[-1] if "pad" in spec.special_tokens[-1] else spec.stop_tokens[0]
    if spec.template:
        text = resources.files("deltafin.tiny").joinpath("templates", spec.template).read_text()
        tokenizer.chat_template = spec.template_prefix + text
    model = spec.model(len(tokenizer))
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in spec.stop_tokens]
    model.config.eos_token_id = stop_ids
    model.generation_config.eos_token_id = stop_ids
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "deltafin_tiny.json").write_text(json.dumps({"family": family, "seed": seed}))
    return out
