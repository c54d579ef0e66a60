"""A GGUF file with K-quant matrices (Q4_K, Q6_K) served natively: the default model with every matrix whose
input width is a multiple of 256 (ffn_down) re-quantized by deltafin.testing.kquant_files' simple quantizers (Q4_K in
even layers, Q6_K in odd ones, as Q4_K_M files mix them), the others kept in their own blocks. It loads without the dequantizing fallback, runs the native C forward, and stays
close to the file it came from. The kernels themselves are tested in test_kernels.py."""

from __future__ import annotations

import types

import pytest
import torch

from deltafin.engine.llama.native import NativeLlamaStep
from deltafin.engine.local.steps import decode_step_for
from deltafin.engine.quant.linear import GGMLLinear
from deltafin.engine.weights import gguf_native
from deltafin.engine.weights.loader import load_model, resolve_model_path
from deltafin.testing import compose_config
from deltafin.testing.kquant_files import requantize_k

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory, config):
    source = resolve_model_path(config.model.path)
    target = requantize_k(
        source, tmp_path_factory.mktemp("kquants") / "Q4_K-Q6_K.gguf", "Q4_K", rest="keep", odd_layers="Q6_K"
    )
    assert gguf_native.unsupported(target) is None
    kconfig = compose_config([f"model.path={target}"])
    return load_model(kconfig.model, kconfig.placement)


def test_a_kquant_file_loads_natively_and_stays_close_to_its_source(kquant_model, loaded_model):
    import gguf

    loaded = kquant_model
    model = loaded.model
    for i, layer in enumerate(model.model.layers):
        kind = int(gguf.GGMLQuantizationType.Q6_K if i % 2 else gguf.GGMLQuantizationType.Q4_K)
        assert isinstance(layer.mlp.down_proj, GGMLLinear) and layer.mlp.down_proj.ggml_type == kind
        assert layer.mlp.down_proj.row_bytes == 1536 // 256 * gguf.GGML_QUANT_SIZES[kind][1]
        assert layer.mlp.up_proj.ggml_type == loaded_model.model.model.layers[0].mlp.up_proj.ggml_type  # kept
    assert isinstance(decode_step_for(model), NativeLlamaStep)
    deltas, agree = [], []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([loaded.tokenizer(prompt).input_ids])
            got = torch.log_softmax(model(ids).logits[0].float(), -1)  # the native C forward
            want = torch.log_softmax(loaded_model.model(ids).logits[0].float(), -1)
            top = want.argmax(-1)
            deltas.append((got.gather(1, top[:, None]) - want.gather(1, top[:, None])).abs().mean())
            agree.append((got.argmax(-1) == top).float().mean())
    # Measured: mean |delta logprob| of the source's top token 0.15, top-1 agreement 0.94 (the source is Q4_1:
    # its ffn_down dequantized and re-quantized by a plain quantizer, half of it to 4 bits).
    assert float(torch.stack(deltas).mean()) < 0.3 and float(torch.stack(agree).mean()) >= 0.8, (deltas, agree)


def test_a_kquant_matrix_of_a_width_not_in_whole_superblocks_is_refused(monkeypatch):
    """A file as llama.cpp never writes it (it stores such a matrix in another type): a reader's stand-in."""
    import gguf

    tensor = types.SimpleNamespace(
        name="blk.0.attn_q.weight", tensor_type=gguf.GGMLQuantizationType.Q4_K, shape=[576, 576]
    )
    reader = types.SimpleNamespace(architecture="llama", tensors=[tensor])
    monkeypatch.setattr(gguf_native, "_reader", lambda path: reader)
    reason = gguf_native.unsupported("nowhere.gguf")
    assert reason is not None and "576" in reason and "256" in reason
    tensor.shape = [512, 576]
    assert gguf_native.unsupported("nowhere.gguf") is None
