"""The gpu tier: CUDA placements, where torch sees a GPU (skipped elsewhere, failed where
DELTAFIN_REQUIRE_TIERS names gpu). The default model in float32 on the GPU decodes the CPU's greedy tokens;
in bfloat16 with the compiled static step it decodes, batched and solo alike."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deltafin.engine import EngineFront, GenerationJob, TextDelta
from deltafin.engine.local.engine import LocalEngine
from deltafin.engine.weights.loader import load_model
from deltafin.protocol.sampling import SamplingParams
from tests.conftest import compose_config
from tests.tiers import unavailable

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    unavailable("gpu", "no CUDA device visible to torch")

PROMPT = "The capital of France is"


def greedy(overrides: list[str], prompts: list[str], tokens: int = 12) -> list[list[int]]:
    config = compose_config(overrides)
    loaded = load_model(config.model, config.placement, max_batch=config.engine.max_batch)
    engine = EngineFront(LocalEngine(loaded), max_waiting=8, timeout_s=60, memo_entries=0)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def one(prompt: str) -> list[int]:
        stream = await engine.start([GenerationJob(tuple(loaded.tokenizer(prompt).input_ids), params)])
        return [i for e in [e async for e in stream] if isinstance(e, TextDelta) for i in e.token_ids]

    async def run() -> list[list[int]]:
        try:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        finally:
            await engine.aclose()

    return asyncio.run(run())


def test_float32_on_cuda_is_the_cpus_greedy_output():
    cpu = greedy(["model.gguf_weights=dequantize"], [PROMPT])
    gpu = greedy(["placement=cuda", "placement.dtype=float32", "model.gguf_weights=dequantize"], [PROMPT])
    assert gpu == cpu


def test_bfloat16_compiled_step_batched_equals_solo():
    overrides = ["placement=cuda", "placement.compile=true", "model.gguf_weights=dequantize"]
    prompts = [PROMPT, "Write a haiku about the sea.", "1, 2, 3, 4,"]
    batched = greedy(overrides, prompts)
    solo = [greedy(overrides, [p])[0] for p in prompts]
    assert batched == solo and all(len(ids) == 12 for ids in batched)
