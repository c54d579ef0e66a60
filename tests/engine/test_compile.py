"""placement.compile: the decode step under torch.compile runs and matches eager, rows joining and leaving
included. The fused Llama step runs with static shapes, one graph per (row bucket, capacity bucket) pair
whatever the number of steps; transformers' step for other architectures keeps dynamic shapes.

The tests use the `aot_eager` backend (graph capture without C++ code generation, seconds instead of minutes
on a 2-core machine); the server uses inductor, checked by hand (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from deltafin.engine.kv.batch import BatchKV
from deltafin.engine.llama.fused import fused_llama_step
from deltafin.engine.llama.fused_static import StaticFusedStep
from deltafin.engine.local.generator import compiled_decode_step, decode_step, prefill
from deltafin.engine.local.steps import decode_step_for
from deltafin.engine.quant.quantize import quantize_model


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


def decode_run(model, step, steps=8, joining=None, keeping=None):
    """Two rows of different lengths; greedy. After step i, `keeping[i]` rows stay (by index) and `joining[i]`
    rows of a third prompt join; by default the first row leaves after step 2 and one row joins after step 4.
    Returns every step's logits, the (rows, width) of every step, and one-row caches taken from the batch as
    the engine gives them to the prefix cache (the last row after every step, and every row that leaves), each
    with a copy of its contents at the time."""
    joining = {4: 1} if joining is None else joining
    keeping = {2: [1]} if keeping is None else keeping
    kv = BatchKV(torch.device("cpu"))
    out, shapes, handed_out = [], [], []

    def hand_out(row):
        cache = kv.row_cache(row)
        handed_out.append((cache, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]))

    with torch.inference_mode():
        for prompt in ([1, 2, 3, 4, 5], [7, 8, 9]):
            cache = DynamicCache(config=model.config)
            prefill(model, prompt, cache, 0)
            kv.add(cache, len(prompt))
        tokens = torch.tensor([[5], [6]])  # [B, 1]
        for i in range(steps):
            mask, positions = kv.step_inputs()
            shapes.append(tuple(mask.shape))
            logits = step(model, tokens, mask, positions, kv.cache)  # [B, V]
            kv.advanced(mask)
            out.append(logits.clone())
            hand_out(kv.rows - 1)
            tokens = logits.argmax(-1, keepdim=True)
            if i in keeping:
                for row in sorted(set(range(kv.rows)) - set(keeping[i])):
                    hand_out(row)
                kv.keep(keeping[i])
                tokens = tokens[keeping[i]]
            if i in joining:
                cache = DynamicCache(config=model.config)
                prefill(model, [3, 1, 4, 1, 5, 9, 2, 6], cache, 0)
                kv.add(cache, 8, copies=joining[i])
                tokens = torch.cat([tokens, torch.tensor([[6]] * joining[i])])
    return out, shapes, handed_out


def test_compiled_decode_step_matches_eager():
    model = tiny_llama()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, _, _ = decode_run(model, decode_step)
    compiled, _, _ = decode_run(model, compiled_decode_step(backend="aot_eager"))
    assert [tuple(t.shape) for t in compiled] == [tuple(t.shape) for t in eager]
    assert max(float((a - b).abs().max()) for a, b in zip(eager, compiled)) < 1e-5
    # Batch sizes 2 -> 1 -> 2 and a growing cache: a handful of graphs, not one per step.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] < 8


def test_compile_picks_static_shapes_for_the_fused_step_only():
    assert isinstance(decode_step_for(tiny_llama(), compile=True), StaticFusedStep)
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
    assert not isinstance(decode_step_for(qwen3, compile=True), StaticFusedStep)


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_static_step_matches_eager_with_one_graph_per_bucket_pair(tmp_path, weights):
    """Rows 2 -> 1 -> 4 -> 3 (row buckets 2, 1, 4, 4: the last with a dummy row, and rows replaced within one
    bucket), widths 6 to 17 crossing the capacity bucket of 16: logits equal the eager fused step's, one graph per bucket pair (not per step), and every
    view handed out (as to the prefix cache) keeps its contents while later steps write into the buffers.
    int8: the C kernel is a torch operator inside the graph (a ctypes call would split it)."""
    model = tiny_llama()
    if weights == "int8":
        (tmp_path / "src").mkdir()
        quantize_model(model, "int8", source=tmp_path / "src", cache_dir=tmp_path)
    schedule = dict(steps=14, joining={4: 3}, keeping={2: [1], 8: [1, 2, 3]})
    eager, shapes, _ = decode_run(model, fused_llama_step(model), **schedule)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    static = StaticFusedStep(fused_llama_step(model), backend="aot_eager", bucket=16)
    got, _, handed_out = decode_run(model, static, **schedule)
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in eager]
    assert max(float((a - b).abs().max()) for a, b in zip(eager, got)) < 1e-5
    assert [rows for rows, _ in shapes] == [2, 2, 2, 1, 1, 4, 4, 4, 4, 3, 3, 3, 3, 3]
    assert [width for _, width in shapes] == list(range(6, 9)) + [7, 8] + list(range(9, 18))
    assert set(static.graphs) == {(2, 16), (1, 16), (4, 16), (4, 32)}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 4
    assert not torch._dynamo.utils.counters["graph_break"]
    for row, snapshot in handed_out:
        for layer, (keys, values) in zip(row.layers, snapshot):
            assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_static_step_under_inductor_matches_eager():
    """The server's backend: code generated for one bucket pair (~25 s on 2 cores) gives the eager step's logits.
    float32 only: with int8 weights inductor took 200 s here (run by hand: docs/benchmarks.md)."""
    model = tiny_llama()
    eager, _, _ = decode_run(model, fused_llama_step(model), steps=4, joining={}, keeping={})
    torch._dynamo.reset()
    static = StaticFusedStep(fused_llama_step(model), backend="inductor", bucket=16)
    got, _, _ = decode_run(model, static, steps=4, joining={}, keeping={})
    assert set(static.graphs) == {(2, 16)}
    assert max(float((a - b).abs().max()) for a, b in zip(eager, got)) < 1e-5
