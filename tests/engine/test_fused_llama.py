"""The fused Llama decode step: the same logits as transformers' forward over the same batched cache (rows
joining and leaving), on float32 and int8 weights; its in-place cache append never changes a view handed out
earlier; models it does not cover keep the transformers step."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from deltafin.engine.kv.batch import BatchKV
from deltafin.engine.llama.fused import FusedLlamaStep, fused_llama_step
from deltafin.engine.local.generator import decode_step, prefill
from deltafin.engine.local.steps import decode_step_for
from deltafin.engine.quant.quantize import quantize_model
from tests.engine.test_compile import decode_run  # two rows, one leaving, one joining; caches handed out


def tiny_llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    options = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
    )
    options.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**options)).eval()


def assert_same_run(model, fused, tolerance):
    reference, _, _ = decode_run(copy.deepcopy(model), decode_step, steps=10)
    got, _, handed_out = decode_run(model, fused, steps=10)
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in reference]
    assert max(float((a - b).abs().max()) for a, b in zip(reference, got)) < tolerance
    # In-place appends went only past the views handed out: each one still holds what it held then.
    for row, snapshot in handed_out:
        for layer, (keys, values) in zip(row.layers, snapshot):
            assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_float32_logits_match_transformers():
    model = tiny_llama()
    fused = fused_llama_step(model)
    assert isinstance(fused, FusedLlamaStep)
    assert_same_run(model, fused, 1e-5)


def test_finished_batches_leave_no_buffers_behind():
    model = tiny_llama()
    fused = fused_llama_step(model)
    for _ in range(3):
        decode_run(model, fused, steps=4)
    import gc

    gc.collect()
    assert len(fused._room) == 0  # every batch's cache is gone, so are the buffers the step kept for it


def test_attention_and_mlp_biases_are_kept():
    model = tiny_llama(attention_bias=True, mlp_bias=True)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_()  # transformers starts them at zero, which would hide a dropped bias
    assert_same_run(model, fused_llama_step(model), 1e-5)


def test_int8_logits_match_transformers_on_the_same_weights(tmp_path):
    model = tiny_llama()
    (tmp_path / "src").mkdir()
    quantize_model(model, "int8", source=tmp_path / "src", cache_dir=tmp_path)
    # Same int8 weights and kernel on both sides: only fusing q/k/v and gate/up differs.
    assert_same_run(model, fused_llama_step(model), 1e-4)


def test_int4_projections_run_side_by_side(tmp_path):
    model = tiny_llama()
    (tmp_path / "src").mkdir()
    quantize_model(model, "int4", source=tmp_path / "src", cache_dir=tmp_path)
    assert_same_run(model, fused_llama_step(model), 1e-4)


def test_fusing_keeps_the_prefill_weights_the_same():
    model = tiny_llama()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    fused_llama_step(model)
    after = dict(model.named_parameters())
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_other_architectures_keep_the_transformers_step():
    torch.manual_seed(0)
    qwen3 = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    ).eval()
    assert fused_llama_step(qwen3) is None
    assert decode_step_for(qwen3) is decode_step
    assert fused_llama_step(tiny_llama(hidden_act="gelu")) is None


@pytest.mark.parametrize("rows", [1, 3])
def test_the_real_model_decodes_the_same_greedy_tokens(float_model, rows):
    """The default model (SmolLM2, Llama architecture) dequantized to float32 takes the fused step; 16 greedy
    tokens equal transformers' own, for one row and for three rows decoding together. (Served with its GGUF
    blocks it takes the native step instead: tests/engine/test_native_step.py.)"""
    model = float_model.model
    fused = decode_step_for(model)
    assert isinstance(fused, FusedLlamaStep)
    ids = float_model.tokenizer("The capital of France is").input_ids

    def greedy(step):
        kv = BatchKV(torch.device("cpu"))
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            logits, _ = prefill(model, ids, cache, 0)
            kv.add(cache, len(ids), copies=rows)
            tokens = logits.argmax().view(1, 1).repeat(rows, 1)
            out = []
            for _ in range(16):
                mask, positions = kv.step_inputs()
                tokens = step(model, tokens, mask, positions, kv.cache).argmax(-1, keepdim=True)
                kv.advanced(mask)
                out.append(tokens[:, 0].tolist())
        return out

    assert greedy(fused) == greedy(decode_step)
