"""placement.compile: the batched decode step under torch.compile runs and matches eager, rows joining and
leaving included, without a recompile per step.

The test uses the `aot_eager` backend (graph capture without C++ code generation, seconds instead of minutes
on a 2-core machine); the server uses inductor, checked by hand (docs/benchmarks.md)."""

from __future__ import annotations

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from deltafin.engine.batch import BatchKV
from deltafin.engine.fused_llama import fused_llama_step
from deltafin.engine.generator import compiled_decode_step, decode_step, prefill
from deltafin.engine.quantize import quantize_model


def decode_run(model, step, steps=8):
    """Two rows of different lengths, one leaving after 3 steps, a third joining after 5: every step's logits."""
    kv = BatchKV(torch.device("cpu"))
    out = []
    with torch.inference_mode():
        for prompt in ([1, 2, 3, 4, 5], [7, 8, 9]):
            cache = DynamicCache(config=model.config)
            prefill(model, prompt, cache, 0)
            kv.add(cache, len(prompt))
        tokens = torch.tensor([[5], [6]])  # [B, 1]
        for i in range(steps):
            mask, positions = kv.step_inputs()
            logits = step(model, tokens, mask, positions, kv.cache)  # [B, V]
            kv.advanced(mask)
            out.append(logits.clone())
            tokens = logits.argmax(-1, keepdim=True)
            if i == 2:
                kv.keep([1])
                tokens = tokens[1:]
            if i == 4:
                cache = DynamicCache(config=model.config)
                prefill(model, [3, 1, 4, 1, 5, 9, 2, 6], cache, 0)
                kv.add(cache, 8)
                tokens = torch.cat([tokens, torch.tensor([[6]])])
    return out


def test_compiled_decode_step_matches_eager():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = decode_run(model, decode_step)
    compiled = decode_run(model, compiled_decode_step(backend="aot_eager"))
    assert [tuple(t.shape) for t in compiled] == [tuple(t.shape) for t in eager]
    assert max(float((a - b).abs().max()) for a, b in zip(eager, compiled)) < 1e-5
    # Batch sizes 2 -> 1 -> 2 and a growing cache: a handful of graphs, not one per step.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] < 8


def test_compiled_fused_step_matches_eager_int8_kernel_included(tmp_path):
    """The fused Llama step with int8 weights: the C kernel is a torch operator inside the graph (a ctypes
    call would split it), and the whole step is one graph for every batch size and cache length."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    (tmp_path / "src").mkdir()
    quantize_model(model, "int8", source=tmp_path / "src", cache_dir=tmp_path)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = decode_run(model, fused_llama_step(model))
    compiled = decode_run(model, compiled_decode_step(backend="aot_eager", step=fused_llama_step(model)))
    assert max(float((a - b).abs().max()) for a, b in zip(eager, compiled)) < 1e-5
    assert not torch._dynamo.utils.counters["graph_break"]
    # One graph for one row (dynamo always specializes a size of 1), one for several, one more at most when
    # the cache length first changes: not one per step (this run has 10 steps).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3
