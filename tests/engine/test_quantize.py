"""Weight-only int8 / int4 of the real default model: quality against float32 on a fixed prompt set, caching."""

from __future__ import annotations

import copy

import pytest
import torch

from deltafin.engine.quant.quantize import Int4Linear, Int8Linear, quantize_model, supported

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colours are",
]
NEW_TOKENS = 16
#: mode -> (bound on the mean |logprob difference| of float32's greedy tokens, least top-1 agreement)
BOUNDS = {"int8": (0.15, 0.9), "int4": (0.3, 0.75)}


@pytest.fixture(scope="module")
def reference(float_model):
    """float32 greedy continuations of the prompt set and their logprobs."""
    tok, model = float_model.tokenizer, float_model.model
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([tok(prompt).input_ids])
            seq = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            out.append((seq, ids.shape[1], torch.log_softmax(model(seq).logits[0].float(), -1)))
    return out


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quality_against_float32(float_model, reference, tmp_path, mode):
    """Teacher-forced on float32's own greedy tokens: the quantized model gives them nearly the same logprobs
    and mostly the same argmax."""
    if supported(mode, torch.device("cpu")):
        pytest.skip(supported(mode, torch.device("cpu")))
    model = quantize_model(copy.deepcopy(float_model.model), mode, source=float_model.source, cache_dir=tmp_path)
    kind = Int8Linear if mode == "int8" else Int4Linear
    assert isinstance(model.lm_head, kind) and isinstance(model.model.layers[0].mlp.up_proj, kind)
    diffs, agree = [], []
    with torch.inference_mode():
        for seq, n, ref in reference:
            got = torch.log_softmax(model(seq).logits[0].float(), -1)
            target = seq[0, n:, None]  # [T, 1]; position i-1 predicts token i
            diffs.append((ref[n - 1 : -1].gather(-1, target) - got[n - 1 : -1].gather(-1, target)).abs().mean())
            agree.append((got[n - 1 : -1].argmax(-1) == target[:, 0]).float().mean())
    max_diff, min_agree = BOUNDS[mode]
    assert float(torch.stack(diffs).mean()) < max_diff
    assert float(torch.stack(agree).mean()) >= min_agree


def test_quantized_weights_are_cached(float_model, tmp_path):
    first = quantize_model(copy.deepcopy(float_model.model), "int8", source=float_model.source, cache_dir=tmp_path)
    (cached,) = (tmp_path / "quantized").glob("*-int8-*.safetensors")
    stamp = cached.stat().st_mtime_ns
    second = quantize_model(copy.deepcopy(float_model.model), "int8", source=float_model.source, cache_dir=tmp_path)
    assert cached.stat().st_mtime_ns == stamp  # read, not rewritten
    assert torch.equal(first.lm_head.weight, second.lm_head.weight) and first.lm_head.weight.dtype == torch.int8
    # Weights read from the file run as well as fresh ones (a 40-token prefill crashed on unaligned ones).
    ids = torch.arange(100, 140).unsqueeze(0)
    with torch.inference_mode():
        assert torch.equal(first(ids).logits, second(ids).logits)


def test_unknown_mode_and_wrong_device_are_refused():
    assert "one of" in supported("int3", torch.device("cpu"))
    assert "CPU" in supported("int8", torch.device("cuda"))
    assert supported("none", torch.device("cuda")) is None
