"""Speculative decoding on hybrid models (attention + linear-attention layers): tiny Kimi K3 (Kimi Linear) and a
tiny Qwen3-Next. A rejected draft token has been through the recurrent state, which cannot be cut back: the row's
state comes back from a copy and its kept tokens are fed again. The oracle is the same engine without
speculation, and transformers' `generate`."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deltafin.config import SpeculativeConfig
from deltafin.engine import EngineFront, Finished, GenerationJob, TextDelta
from deltafin.engine.local.engine import LocalEngine
from deltafin.engine.weights.loader import load_model
from deltafin.protocol.sampling import SamplingParams
from deltafin.tiny import write_tiny_model
from deltafin.tiny.architectures import qwen3_next
from tests.conftest import tiny_config
from tests.engine.test_hybrid_engine import generate  # transformers' greedy generate: the oracle

MODELS = {"kimi_k3": ("kimi_k3", None), "qwen3_next": ("qwen3", qwen3_next)}


@pytest.fixture(scope="module", params=list(MODELS))
def loaded(request, tmp_path_factory):
    family, architecture = MODELS[request.param]
    path = write_tiny_model(family, tmp_path_factory.mktemp(request.param), architecture=architecture)
    config = tiny_config(family, path)
    return load_model(config.model, config.placement)


@pytest.fixture
def run(loop):
    return loop.run_until_complete


def front_for(loaded, method: str) -> EngineFront:
    engine = LocalEngine(loaded, max_batch=8, speculative=SpeculativeConfig(method=method, ngram_min=1, ngram_max=3))
    return EngineFront(engine, max_waiting=16, timeout_s=60.0, memo_entries=0)


def repetitive_prompt(loaded, seed: int) -> tuple[int, ...]:
    """Random tokens with a stretch repeated: tiny random models also repeat themselves, so n-gram drafts come."""
    g = torch.Generator().manual_seed(seed)
    piece = torch.randint(0, len(loaded.tokenizer) - 20, (12,), generator=g).tolist()
    other = torch.randint(0, len(loaded.tokenizer) - 20, (5,), generator=g).tolist()
    return tuple(piece + other + piece + other + piece[:6])


async def collect(front: EngineFront, jobs) -> dict[int, list[int]]:
    stream = await front.start(jobs)
    tokens: dict[int, list[int]] = {}
    async for event in stream:
        if isinstance(event, TextDelta):
            tokens.setdefault(event.choice, []).extend(event.token_ids)
        elif isinstance(event, Finished):
            tokens.setdefault(event.choice, [])
    return tokens


def greedy(ids, n: int) -> GenerationJob:
    return GenerationJob(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


def test_greedy_rows_alone_and_together_equal_none_and_generate(loaded, run):
    plain, spec = front_for(loaded, "none"), front_for(loaded, "ngram")
    jobs = [greedy(repetitive_prompt(loaded, seed), n) for seed, n in ((1, 40), (2, 25), (3, 33))]
    solo = [run(collect(plain, [job]))[0] for job in jobs]
    assert [run(collect(spec, [job]))[0] for job in jobs] == solo
    assert solo[0] == generate(loaded, jobs[0].prompt_ids, 40)

    async def together():
        tasks = []
        for job in jobs:
            tasks.append(asyncio.ensure_future(collect(spec, [job])))
            await asyncio.sleep(0.02)
        return [tokens[0] for tokens in await asyncio.gather(*tasks)]

    assert run(together()) == solo
    run(plain.client.aclose())
    run(spec.client.aclose())


class OracleDrafter:
    """Guesses each row's next two tokens right (from the plain run's output) and the third wrong: every step
    has accepted tokens and a rejected one, which has been through the recurrent state (the random tiny models
    rarely repeat themselves, so n-gram drafts alone may never be accepted)."""

    cost_per_token = 0.0

    def __init__(self, answers: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.answers, self.vocab = answers, vocab

    def propose(self, rows, limits) -> list[list[int]]:
        drafts = []
        for row, limit in zip(rows, limits):
            context = [*row.ids, row.pending]
            prompt = next(p for p in self.answers if tuple(context[: len(p)]) == p)
            truth = self.answers[prompt][len(context) - len(prompt) :]
            guess = truth[:2] + [(truth[2] + 1) % self.vocab] if len(truth) > 2 else truth
            drafts.append(guess[:limit])
        return drafts


def test_rejected_drafts_give_the_row_its_state_back(loaded, run):
    plain, spec = front_for(loaded, "none"), front_for(loaded, "ngram")
    jobs = [greedy(repetitive_prompt(loaded, seed), n) for seed, n in ((7, 30), (8, 22))]
    solo = [run(collect(plain, [job]))[0] for job in jobs]
    speculation = spec.client.speculation
    speculation.drafter = OracleDrafter(
        {job.prompt_ids: answer for job, answer in zip(jobs, solo)}, len(loaded.tokenizer)
    )
    assert run(collect(spec, jobs)) == {0: solo[0], 1: solo[1]}
    assert speculation.accepted > 0, "no draft was accepted"
    assert speculation.drafted > speculation.accepted, "no draft was rejected (nothing rolled back)"
    run(plain.client.aclose())
    run(spec.client.aclose())


def test_seeded_choices_equal_none(loaded, run):
    plain, spec = front_for(loaded, "none"), front_for(loaded, "ngram")
    ids = repetitive_prompt(loaded, 4)
    jobs = [GenerationJob(ids, SamplingParams(max_tokens=24, temperature=0.7, seed=s, ignore_eos=True)) for s in (1, 2)]
    assert run(collect(spec, jobs)) == run(collect(plain, jobs))
    run(plain.client.aclose())
    run(spec.client.aclose())


def test_a_conversation_reuses_the_state_a_speculating_row_left(loaded, run):
    """The state a row gives back after speculative steps is exactly its tokens': the next turn, which starts
    from it, gives a cold run's tokens."""
    spec = front_for(loaded, "ngram")
    first = repetitive_prompt(loaded, 5)
    answer = run(collect(spec, [greedy(first, 30)]))[0]
    second = (*first, *answer, *repetitive_prompt(loaded, 6)[:7])
    stream_tokens = run(collect(spec, [greedy(second, 12)]))[0]
    assert stream_tokens == generate(loaded, second, 12)
    run(spec.client.aclose())
