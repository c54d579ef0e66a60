"""Deltafin's Kimi K3 language model (deltafin.engine.models.kimi_k3) against the checkpoint's own model code
(the reference `modeling_kimi_linear.py` from the llmcompressor wheel, tests/k3_reference.py), on a tiny K3 with
every released feature on, and with each feature off in turn: the same logits for a full pass, for a prefill
continued token by token through transformers' cache layers, and for a left-padded batch.

The reference runs on pure-torch stand-ins for its fla kernels (tests/k3_standins.py); they are proven here too:
with K3's features off, the reference on the stand-ins is transformers' Kimi Linear, whose own torch fallbacks
are an independent implementation of the same kernels."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import DynamicCache

from deltafin.engine.models.kimi_k3 import KimiK3ForCausalLM
from deltafin.tiny.kimi_k3 import PREFIX, TEXT_CONFIG, checkpoint_tensors, kimi_k3, text_config
from tests.k3_reference import reference_kimi_linear, reference_model

VOCAB = 300
#: float32 logits of two implementations of the same math (the reference's are about 1 to 3 in size)
CLOSE = 1e-4


def linear(**keys: Any) -> dict[str, Any]:
    return {"linear_attn_config": {**TEXT_CONFIG["linear_attn_config"], **keys}}


#: a K3 feature (or routing option) off, or set otherwise: the config keys that do it
VARIANTS: dict[str, dict[str, Any]] = {
    "every feature on": {},
    "no attention residuals": {"attn_res_block_size": None},
    "no latent MoE": {"routed_expert_hidden_size": None, "latent_moe_use_norm": False},
    "latent MoE without its norm": {"latent_moe_use_norm": False},
    "silu instead of SiTU": {"hidden_act": "silu", "activation_situ_beta": None, "activation_situ_linear_beta": None},
    "SiTU without its linear beta": {"activation_situ_linear_beta": None},
    "no MLA output gate": {"mla_use_output_gate": False},
    "no KDA gate lower bound": linear(gate_lower_bound=None),
    "low-rank KDA output gate": linear(use_full_rank_gate=False),
    "softmax routing": {"moe_router_activation_func": "softmax"},
    "grouped routing": {"num_experts": 16, "num_expert_group": 4, "topk_group": 2, "num_experts_per_token": 3},
    "one routed expert per token": {"num_experts_per_token": 1},
    "plain q projection": {"q_lora_rank": None},
    "attention residual blocks of three": {"attn_res_block_size": 3},
}


def reference_names(model: KimiK3ForCausalLM) -> dict[str, torch.Tensor]:
    return {name.removeprefix(PREFIX): tensor for name, tensor in checkpoint_tensors(model).items()}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request):
    """(Deltafin's model, the reference model) with the same weights."""
    torch.manual_seed(0)
    ours = kimi_k3(VOCAB, **VARIANTS[request.param])
    reference = reference_model(text_config(ours.config), reference_names(ours))
    return ours, reference


def ids(batch: int, tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def test_a_full_pass_is_the_references(pair):
    ours, reference = pair
    tokens = ids(2, 21, seed=1)
    with torch.inference_mode():
        expected = reference(input_ids=tokens, use_cache=False).logits
        got = ours(input_ids=tokens).logits
    assert (got - expected).abs().max() < CLOSE


def test_a_prefill_continued_through_the_cache_is_the_references_full_pass(pair):
    """A 9-token prefill (the chunked KDA), a 3-token continuation, then one token at a time (the recurrent KDA
    step, the MLA latent cache growing), through transformers' cache layers of the model's kinds."""
    ours, reference = pair
    tokens = ids(2, 20, seed=2)
    cache = DynamicCache(config=ours.config)
    assert [type(layer).__name__ for layer in cache.layers] == [
        "LinearAttentionLayer" if kind == "linear_attention" else "DynamicLayer" for kind in ours.config.layer_types
    ]
    with torch.inference_mode():
        expected = reference(input_ids=tokens, use_cache=False).logits
        pieces = [ours(input_ids=tokens[:, :9], cache=cache, use_cache=True).logits]
        pieces.append(ours(input_ids=tokens[:, 9:12], cache=cache, use_cache=True).logits)
        for t in range(12, 20):
            pieces.append(ours(input_ids=tokens[:, t : t + 1], cache=cache, use_cache=True).logits)
    assert (torch.cat(pieces, dim=1) - expected).abs().max() < CLOSE


def test_a_left_padded_batch_is_the_references(pair):
    """Row 1 left-padded by 5: the reference unpads it for KDA (varlen); Deltafin zeroes its padding. Both give
    its solo run's logits at its real positions."""
    ours, reference = pair
    tokens = ids(2, 16, seed=3)
    mask = torch.ones_like(tokens)
    mask[1, :5] = 0
    with torch.inference_mode():
        expected = reference(input_ids=tokens, attention_mask=mask, use_cache=False).logits
        got = ours(input_ids=tokens, attention_mask=mask).logits
        solo = ours(input_ids=tokens[1:, 5:]).logits
    assert (got[0] - expected[0]).abs().max() < CLOSE
    assert (got[1, 5:] - expected[1, 5:]).abs().max() < CLOSE
    assert (got[1, 5:] - solo[0]).abs().max() < CLOSE


def test_mla_with_its_latents_expanded_is_the_references_too():
    """MLA runs in the latent space where kv_b_proj is float (every test above); a quantized kv_b_proj expands
    the cached latents to per-head keys and values instead: the same logits, prefill and decode."""
    torch.manual_seed(0)
    ours = kimi_k3(VOCAB)
    reference = reference_model(text_config(ours.config), reference_names(ours))
    for layer in ours.model.layers:
        if not layer.kda:
            layer.self_attn.absorb = False
    tokens = ids(2, 14, seed=6)
    cache = DynamicCache(config=ours.config)
    with torch.inference_mode():
        expected = reference(input_ids=tokens, use_cache=False).logits
        pieces = [ours(input_ids=tokens[:, :8], cache=cache, use_cache=True).logits]
        for t in range(8, 14):
            pieces.append(ours(input_ids=tokens[:, t : t + 1], cache=cache, use_cache=True).logits)
    assert (torch.cat(pieces, dim=1) - expected).abs().max() < CLOSE


def test_the_checkpoint_names_and_shapes_are_the_reference_classes():
    """Every tensor Deltafin's class reads or writes (checkpoint layout) is a parameter of the reference class built
    on the same text_config, with its shape, and none is missing."""
    torch.manual_seed(0)
    ours = kimi_k3(VOCAB)
    mine = {name: tuple(t.shape) for name, t in reference_names(ours).items()}
    theirs = {name: tuple(t.shape) for name, t in reference_kimi_linear(text_config(ours.config)).state_dict().items()}
    assert mine == theirs


def test_the_tiny_k3_folder_is_the_released_layout(tmp_path):
    """`python -m deltafin.tiny --family kimi_k3`: the released checkpoint's wrapper and names (language_model.*
    beside a vision tower), the language model the reference class built on its text_config."""
    from deltafin.tiny import write_tiny_model

    folder = write_tiny_model("kimi_k3", tmp_path / "k3")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"] and config["model_type"] == "kimi_k3"
    text = config["text_config"]
    assert text["model_type"] == "kimi_linear"
    assert text["attn_res_block_size"] and text["routed_expert_hidden_size"] and text["hidden_act"] == "situ"
    assert text["mla_use_output_gate"] and text["linear_attn_config"]["use_full_rank_gate"]
    assert text["linear_attn_config"]["gate_lower_bound"] == -5.0
    reference = {name: tuple(t.shape) for name, t in reference_kimi_linear(text).state_dict().items()}
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        names = weights.keys()  # (a safe_open handle is not iterable itself)
        ours = {
            name.removeprefix(PREFIX): tuple(weights.get_slice(name).get_shape())
            for name in names
            if name.startswith(PREFIX)
        }
        others = {name.split(".")[0] for name in names if not name.startswith(PREFIX)}
    assert ours == reference
    assert others == {"vision_tower", "mm_projector"}


#: K3's features off, and what transformers' Kimi Linear config needs to mean what the reference's does
KIMI_LINEAR = {
    "attn_res_block_size": None,
    "routed_expert_hidden_size": None,
    "latent_moe_use_norm": False,
    "hidden_act": "silu",
    "activation_situ_beta": None,
    "activation_situ_linear_beta": None,
    "mla_use_output_gate": False,
    "num_shared_experts": 1,
    **linear(gate_lower_bound=None, use_full_rank_gate=False),
}


def test_the_stand_ins_are_transformers_kimi_linear(tmp_path):
    """With K3's features off the reference is a Kimi Linear: on its fla stand-ins it gives transformers' Kimi
    Linear's logits (its own chunked and recurrent torch kernels, its conversion of the checkpoint's names), full
    pass and token by token through transformers' cache."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ours = kimi_k3(VOCAB, **KIMI_LINEAR)
    text = text_config(ours.config)
    weights = reference_names(ours)
    reference = reference_model(text, weights)
    # transformers keeps A_log as [1, 1, heads, 1]; the checkpoint as [heads]
    saved = {name: t.reshape(1, 1, -1, 1) if name.endswith("A_log") else t for name, t in weights.items()}
    save_file(saved, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({**text, "model_type": "kimi_linear"}))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(theirs).__module__.startswith("transformers.")
    tokens = ids(2, 24, seed=4)
    with torch.inference_mode():
        expected = theirs(input_ids=tokens).logits
        assert (reference(input_ids=tokens, use_cache=False).logits - expected).abs().max() < CLOSE
        cache = DynamicCache(config=theirs.config)
        steps = [theirs(input_ids=tokens[:, :10], cache=cache, use_cache=True).logits]
        for t in range(10, 24):
            steps.append(theirs(input_ids=tokens[:, t : t + 1], cache=cache, use_cache=True).logits)
        assert (torch.cat(steps, dim=1) - reference(input_ids=tokens, use_cache=False).logits).abs().max() < CLOSE
        assert (ours(input_ids=tokens).logits - expected).abs().max() < CLOSE


def test_bfloat16_keeps_the_gates_and_router_in_float32():
    """Loaded in bfloat16, the KDA decay rates, dt biases and the router stay float32 (as the reference computes
    them from float32 checkpoint tensors), the rest is bfloat16, and a pass stays finite and near float32's
    first logits (later ones part where bfloat16 flips an expert choice, in either implementation)."""
    torch.manual_seed(0)
    ours = kimi_k3(VOCAB)
    tokens = ids(1, 12, seed=5)
    with torch.inference_mode():
        full = ours(input_ids=tokens).logits
    half = KimiK3ForCausalLM.from_pretrained(
        None, config=ours.config, state_dict=ours.state_dict(), dtype=torch.bfloat16
    )
    kept = {name: p.dtype for name, p in half.named_parameters() if name.endswith(("A_log", "dt_bias", "gate.weight"))}
    assert len(kept) == 4 * 2 + 4 and set(kept.values()) == {torch.float32}
    assert half.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.dtype == torch.float32
    assert half.model.layers[1].self_attn.q_proj.weight.dtype == torch.bfloat16
    with torch.inference_mode():
        low = half.eval()(input_ids=tokens).logits.float()
    assert bool(low.isfinite().all())
    assert (low[0, 0] - full[0, 0]).abs().max() < 0.1
