"""Checkpoints of a hybrid model's recurrent state through the real local engine: tiny Kimi K3 (Deltafin's own
K3 class: KDA layers beside MLA) and a tiny Qwen3-Next (gated delta net). A prompt that leaves an earlier one's
path restarts from the last checkpoint within the shared part, in RAM or after a restart from disk; the oracle is
transformers' `generate` on the same model, one cold pass with no cache (greedy tokens; K3's model itself is
proven against its reference code in test_k3_model.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deltafin.engine import EngineFront, Finished, GenerationJob, TextDelta
from deltafin.engine.kv.disk_tier import DiskSettings
from deltafin.engine.kv.prefix_cache import PrefixCacheSettings
from deltafin.engine.local.engine import LocalEngine
from deltafin.engine.weights.loader import load_model
from deltafin.protocol.sampling import SamplingParams
from deltafin.tiny import write_tiny_model
from deltafin.tiny.architectures import qwen3_next
from tests.conftest import tiny_config
from tests.engine.test_hybrid_engine import generate  # transformers' greedy generate: the oracle

MODELS = {"kimi_k3": ("kimi_k3", None), "qwen3_next": ("qwen3", qwen3_next)}
EVERY = 8


@pytest.fixture(scope="module", params=list(MODELS))
def loaded(request, tmp_path_factory):
    family, architecture = MODELS[request.param]
    path = write_tiny_model(family, tmp_path_factory.mktemp(request.param), architecture=architecture)
    config = tiny_config(family, path)
    return load_model(config.model, config.placement)


@pytest.fixture(scope="module")
def run():
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


def front_for(loaded, folder=None, *, prefill_chunk=64) -> EngineFront:
    disk = DiskSettings(str(folder), 1 << 30, block_tokens=EVERY, namespace="tiny") if folder is not None else None
    settings = PrefixCacheSettings(min_tokens=4, state_every_tokens=EVERY, disk=disk)
    engine = LocalEngine(loaded, max_batch=4, prefill_chunk=prefill_chunk, prefix_cache=settings)
    return EngineFront(engine, max_waiting=16, timeout_s=60, memo_entries=0)


def prompt(loaded, n: int, seed: int) -> list[int]:
    ids = torch.randint(0, len(loaded.tokenizer) - 20, (n,), generator=torch.Generator().manual_seed(seed))
    return ids.tolist()


async def collect(front, ids, n=8) -> tuple[list[int], Finished]:
    stream = await front.start(
        [GenerationJob(tuple(ids), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))]
    )
    tokens, finished = [], None
    async for event in stream:
        if isinstance(event, TextDelta):
            tokens.extend(event.token_ids)
        elif isinstance(event, Finished):
            finished = event
    return tokens, finished


def test_a_diverging_suffix_restarts_from_the_last_checkpoint(loaded, run):
    front = front_for(loaded, prefill_chunk=12)  # windows of 12 stop at every checkpoint on the way
    first = prompt(loaded, 41, 1)
    tokens, end = run(collect(front, first))
    assert end.cached_tokens == 0 and tokens == generate(loaded, first)
    edited = [*first[:29], *prompt(loaded, 6, 2)]  # shares 29 tokens: the checkpoint at 24 is the last within them
    tokens, end = run(collect(front, edited))
    assert end.cached_tokens == 24 and tokens == generate(loaded, edited)
    run(front.aclose())


def test_a_conversation_keeps_each_prompt_end_as_a_checkpoint(loaded, run):
    """Turn two extends turn one's prompt and answer (the whole saved state); a third prompt that rewrites turn
    one's answer restarts from the end of turn one's prompt, kept as a checkpoint when its row came back."""
    front = front_for(loaded)
    first = prompt(loaded, 21, 3)
    answer, _ = run(collect(front, first))
    entry = front.client.prefix_cache.entries[0]
    assert len(front.client.prefix_cache) == 1 and len(entry) == len(first) + len(answer) - 1
    assert sorted(entry.book.at) == [8, 16, 21]
    second = [*first, *answer, *prompt(loaded, 5, 4)]
    tokens, end = run(collect(front, second))
    assert end.cached_tokens == len(first) + len(answer) - 1 and tokens == generate(loaded, second)
    rewritten = [*first, *prompt(loaded, 9, 5)]
    tokens, end = run(collect(front, rewritten))
    assert end.cached_tokens == 21 and tokens == generate(loaded, rewritten)
    run(front.aclose())


def test_checkpoints_come_back_from_disk_after_a_restart(loaded, run, tmp_path):
    before = front_for(loaded, tmp_path)
    first = prompt(loaded, 35, 6)
    run(collect(before, first, 2))
    assert before.client.prefix_cache.flush(30)
    run(before.aclose())
    assert len(list(tmp_path.rglob("*.kvs.safetensors"))) == 4  # blocks ending at 8, 16, 24, 32 carry states

    after = front_for(loaded, tmp_path)
    edited = [*first[:27], *prompt(loaded, 4, 7)]
    tokens, end = run(collect(after, edited))
    assert end.cached_tokens == 24 and after.client.prefix_cache.stats.hits["disk"] == 1
    assert tokens == generate(loaded, edited)
    run(after.aclose())
