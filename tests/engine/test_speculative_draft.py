"""Draft-model speculation: a smaller model with the same tokenizer guesses, the main model checks. The draft is
a GGUF served in its own blocks (the default model's first layers, deltafin.testing.draft_files), like the main
model; the output is exactly the main model's without speculation."""

from __future__ import annotations

import asyncio

import pytest

from deltafin.config import SpeculativeConfig
from deltafin.engine import EngineFront, GenerationJob
from deltafin.engine.llama.native import NativeLlamaStep
from deltafin.engine.local.engine import LocalEngine
from deltafin.engine.local.speculative.draft_model import DraftModelDrafter
from deltafin.engine.local.speculative.forward import NativeForward
from deltafin.engine.weights.loader import ModelLoadError, load_model, resolve_model_path
from deltafin.protocol.sampling import SamplingParams
from deltafin.testing import compose_config
from deltafin.testing.draft_files import first_layers
from tests.engine.test_speculative import COPY, OPEN, chat_ids, collect, ending

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def draft(tmp_path_factory, config):
    path = first_layers(resolve_model_path(config.model.path), tmp_path_factory.mktemp("draft") / "first-8.gguf", 8)
    draft_config = compose_config([f"model.path={path}"])
    return load_model(draft_config.model, draft_config.placement)


@pytest.fixture
def run(loop):
    return loop.run_until_complete


def fronts(loaded, draft):
    plain = EngineFront(LocalEngine(loaded), max_waiting=8, timeout_s=120, memo_entries=0)
    settings = SpeculativeConfig(method="draft", draft_path="(loaded)", tokens=6)
    spec = EngineFront(
        LocalEngine(loaded, speculative=settings, draft=draft), max_waiting=8, timeout_s=120, memo_entries=0
    )
    return plain, spec


def test_the_draft_runs_natively_and_changes_nothing(loaded_model, draft, run):
    plain, spec = fronts(loaded_model, draft)
    speculation = spec.client.speculation
    drafter = speculation.drafter
    assert isinstance(drafter, DraftModelDrafter) and isinstance(drafter.forward, NativeForward)
    # 8 of 30 layers, but the output layer too: half the bytes of a main step per guess
    assert isinstance(drafter.forward.step, NativeLlamaStep) and 0.4 < drafter.cost_per_token < 0.6
    # At that price the planner seldom finds a guess worth it; this test checks what drafting does, not whether
    # this draft pays, so guesses are made cheap.
    speculation.planner.token_cost = 0.05
    tokenizer = loaded_model.tokenizer
    jobs = [
        GenerationJob(chat_ids(tokenizer, COPY), SamplingParams(max_tokens=70, temperature=0.0)),
        GenerationJob(chat_ids(tokenizer, OPEN), SamplingParams(max_tokens=40, temperature=0.8, seed=3)),
        GenerationJob(chat_ids(tokenizer, COPY), SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True)),
    ]
    solo = [run(collect(plain, [job])) for job in jobs]

    async def together():
        tasks = []
        for job in jobs:
            tasks.append(asyncio.ensure_future(collect(spec, [job])))
            await asyncio.sleep(0.05)
        return await asyncio.gather(*tasks)

    both = run(together())
    assert [tokens for tokens, _, _ in both] == [tokens for tokens, _, _ in solo]
    assert [ending(end) for _, end, _ in both] == [ending(end) for _, end, _ in solo]
    assert speculation.accepted > 5 and speculation.drafted > speculation.accepted
    # the draft batch follows the main one: every row left it
    run(collect(spec, [jobs[2]]))
    assert len(drafter._rows) <= 1
    run(plain.client.aclose())
    run(spec.client.aclose())


def test_a_draft_with_another_tokenizer_is_refused(loaded_model, tmp_path):
    from deltafin.tiny import write_tiny_model
    from tests.conftest import tiny_config

    path = write_tiny_model("qwen3", tmp_path / "tiny")
    other = load_model(tiny_config("qwen3", path).model, tiny_config("qwen3", path).placement)
    with pytest.raises(ModelLoadError, match="engine.speculative.draft_path: its tokenizer"):
        DraftModelDrafter(other, main=loaded_model)
