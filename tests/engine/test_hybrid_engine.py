"""Hybrid models through the real local engine (loader, owner thread, batch, prefix cache, memo): the tiny Kimi
K3 (Deltafin's own K3 class, in the released layout) and a tiny Qwen3-Next under the qwen3 family's format. The
oracle is the loaded model's own `generate` on the same folder: greedy tokens alone, four at once, after a
prefix-cache hit and from the memo are its own (the K3 class against K3's reference: test_k3_engine.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deltafin.engine import EngineFront, Finished, GenerationJob, TextDelta
from deltafin.engine.local.engine import LocalEngine
from deltafin.engine.weights.loader import load_model
from deltafin.protocol.sampling import SamplingParams
from deltafin.tiny import write_tiny_model
from deltafin.tiny.architectures import qwen3_next
from tests.conftest import tiny_config

#: model -> (family its tokens and format come from, the architecture replacing the family's own, or None)
MODELS = {"kimi_k3": ("kimi_k3", None), "qwen3_next": ("qwen3", qwen3_next)}


@pytest.fixture(scope="module", params=list(MODELS))
def loaded(request, tmp_path_factory):
    family, architecture = MODELS[request.param]
    path = write_tiny_model(family, tmp_path_factory.mktemp(request.param), architecture=architecture)
    config = tiny_config(family, path)
    return load_model(config.model, config.placement)


def front_for(loaded, *, memo_entries: int = 0, prefix_min: int | None = 4) -> EngineFront:
    engine = LocalEngine(loaded, prefix_cache_min_tokens=prefix_min, max_batch=8)
    return EngineFront(engine, max_waiting=16, timeout_s=60.0, memo_entries=memo_entries)


@pytest.fixture
def run(loop):
    return loop.run_until_complete


def prompt(loaded, n: int, seed: int) -> tuple[int, ...]:
    ids = torch.randint(0, len(loaded.tokenizer) - 20, (n,), generator=torch.Generator().manual_seed(seed))
    return tuple(ids.tolist())


def job(ids, n: int = 8) -> GenerationJob:
    return GenerationJob(tuple(ids), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


def generate(loaded, ids, n: int = 8) -> list[int]:
    with torch.inference_mode():
        # an explicit mask: left to itself, generate takes prompt tokens equal to pad_token_id for padding
        tensor = torch.tensor([list(ids)])
        out = loaded.model.generate(
            tensor,
            attention_mask=torch.ones_like(tensor),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


async def collect(front: EngineFront, jobs) -> tuple[list[int], Finished]:
    stream = await front.start(jobs)
    tokens, finished = [], None
    async for event in stream:
        if isinstance(event, TextDelta):
            tokens.extend(event.token_ids)
        elif isinstance(event, Finished):
            finished = event
    return tokens, finished


def test_four_concurrent_requests_equal_their_solo_runs_and_generate(loaded, run):
    """One long request decodes; three more arrive once it has produced text and join its running batch."""
    front = front_for(loaded)
    prompts = [prompt(loaded, n, seed) for n, seed in ((7, 1), (31, 2), (3, 3), (18, 4))]
    jobs = [job(prompts[0], 80)] + [job(p, 10) for p in prompts[1:]]
    solo = [run(collect(front, [j]))[0] for j in jobs]

    async def together():
        events = aiter(await front.start([jobs[0]]))
        first = list(getattr(await anext(events), "token_ids", ()))  # the long row is in the batch, decoding
        others = [asyncio.ensure_future(collect(front, [j])) for j in jobs[1:]]
        async for event in events:
            first.extend(getattr(event, "token_ids", ()))
        return [first] + [tokens for tokens, _ in await asyncio.gather(*others)]

    front.client.step_sizes.clear()
    batched = run(together())
    assert max(front.client.step_sizes) == 4, "the requests did not decode together"
    assert batched == solo
    assert [tokens[:10] for tokens in solo] == [generate(loaded, p, 10) for p in prompts]
    run(front.client.aclose())


def test_a_conversation_reuses_its_saved_state_and_stays_exact(loaded, run):
    """Turn two extends turn one's prompt and answer: it starts from the state saved when turn one's row left
    (exactly its prompt and every fed token), and its tokens are a cold run's."""
    front = front_for(loaded)
    first = prompt(loaded, 20, 5)
    answer, end = run(collect(front, [job(first)]))
    assert end.cached_tokens == 0
    second = (*first, *answer, *prompt(loaded, 6, 6))
    tokens, end = run(collect(front, [job(second)]))
    # the last sampled token of turn one was never fed: the saved state holds everything before it
    assert end.cached_tokens == len(first) + len(answer) - 1
    assert tokens == generate(loaded, second)
    run(front.client.aclose())


def test_a_prompt_that_only_partly_matches_a_saved_state_does_not_use_it(loaded, run):
    """A recurrent state cannot be cut back: a prompt sharing all but the saved prompt's last tokens is
    prefilled from scratch (an attention-only model would reuse the shared part), and stays exact."""
    front = front_for(loaded)
    first = prompt(loaded, 24, 7)
    run(collect(front, [job(first, 2)]))
    edited = (*first[:-3], *prompt(loaded, 5, 8))
    tokens, end = run(collect(front, [job(edited)]))
    assert end.cached_tokens == 0 and tokens == generate(loaded, edited)
    # the saved prompt itself is still there for a prompt it does start
    extended = (*first, *prompt(loaded, 4, 9))
    tokens, end = run(collect(front, [job(extended)]))
    assert end.cached_tokens == len(first) and tokens == generate(loaded, extended)
    run(front.client.aclose())


def test_the_memo_replays_a_hybrid_generation_exactly(loaded, run):
    front = front_for(loaded, memo_entries=8)
    ids = prompt(loaded, 12, 10)
    cold, cold_end = run(collect(front, [job(ids)]))
    warm, warm_end = run(collect(front, [job(ids)]))
    assert warm_end.memo_hit and not cold_end.memo_hit
    assert warm == cold == generate(loaded, ids)
    run(front.client.aclose())


def test_n_choices_share_one_prefill_of_a_hybrid_prompt(loaded, run):
    """Two choices of one request join the batch as two rows from one prefilled state (copied, not shared:
    each row's state moves on its own); seeded sampling gives each choice its solo tokens."""
    front = front_for(loaded)
    ids = prompt(loaded, 15, 11)
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]

    async def both():
        stream = await front.start([GenerationJob(ids, p) for p in params])
        out: dict[int, list[int]] = {0: [], 1: []}
        async for event in stream:
            if isinstance(event, TextDelta):
                out[event.choice].extend(event.token_ids)
        return out

    together = run(both())
    alone = [run(collect(front, [GenerationJob(ids, p)]))[0] for p in params]
    assert [together[0], together[1]] == alone and alone[0] != alone[1]
    run(front.client.aclose())
