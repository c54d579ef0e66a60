"""Placement through accelerate's device_map (placement=auto) on a CPU-only machine, with a tiny model."""

import asyncio

from deltafin.engine import EngineFront, GenerationJob, TextDelta
from deltafin.engine.local.engine import LocalEngine
from deltafin.engine.weights.loader import load_model
from deltafin.protocol.sampling import SamplingParams
from tests.conftest import tiny_config


def test_device_map_auto_loads_and_generates(tiny_models, tmp_path):
    config = tiny_config(
        "glm47",
        tiny_models["glm47"],
        ["placement=auto", "placement.dtype=float32", f"placement.offload_folder={tmp_path}"],
    )
    loaded = load_model(config.model, config.placement)
    # With only a CPU, accelerate's "auto" map puts every module there.
    assert {p.device.type for p in loaded.model.parameters()} == {"cpu"}
    engine = EngineFront(LocalEngine(loaded), max_waiting=1, timeout_s=5, memo_entries=0)

    async def generate():
        stream = await engine.start(
            [GenerationJob((1, 2, 3), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))]
        )
        return [e for e in [e async for e in stream] if isinstance(e, TextDelta)]

    assert len(asyncio.run(generate())) >= 4
