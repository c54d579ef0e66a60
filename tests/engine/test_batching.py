"""Continuous batching over the real default model: rows join and leave, and nothing about a row's output
depends on what runs beside it."""

from __future__ import annotations

import asyncio

import pytest
import structlog
import torch

from deltafin.engine import Finished, GenerationJob, PromptLogprobs, TextDelta
from deltafin.engine.local.engine import LocalEngine
from deltafin.errors import InvalidRequestError
from deltafin.protocol.sampling import Constraint, SamplingParams
from tests.conftest import make_engine
from tests.engine.fakes import AllowListGrammar

PROMPTS = [
    "Tell me about the sea.",
    "Write a haiku about autumn leaves falling in a quiet park.",
    "What is 2 + 2?",
    "List three colours.",
    "Explain why the sky is blue, briefly, in one or two sentences please.",
    "Hi",
    "Name a famous painter and one of their works.",
    "Describe a cat.",
]


def chat_ids(engine, text: str) -> tuple[int, ...]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return tuple(ids["input_ids"] if hasattr(ids, "keys") else ids)


async def collect(front, jobs):
    stream = await front.start(jobs)
    tokens: dict[int, list[int]] = {}
    finished: dict[int, Finished] = {}
    prompt: dict[int, PromptLogprobs] = {}
    async for event in stream:
        if isinstance(event, TextDelta):
            tokens.setdefault(event.choice, []).extend(event.token_ids)
        elif isinstance(event, PromptLogprobs):
            prompt[event.choice] = event
        else:
            finished[event.choice] = event
    return tokens, finished, prompt


@pytest.fixture(scope="module")
def front(loaded_model):
    # No memo: every request must really run, alone or in a batch.
    return make_engine(loaded_model, memo_entries=0, max_waiting=16)


@pytest.fixture
def run(loop):
    return loop.run_until_complete


def alone(run, front, job):
    return run(collect(front, [job]))


def together(run, front, jobs, stagger: float = 0.0):
    """Each job as its own request, all in flight at once (the later ones join a running batch)."""

    async def scenario():
        tasks = []
        for job in jobs:
            tasks.append(asyncio.ensure_future(collect(front, [job])))
            await asyncio.sleep(stagger)
        return await asyncio.gather(*tasks)

    return run(scenario())


class TestSameTokensAloneAndInABatch:
    def test_greedy(self, front, run):
        jobs = [GenerationJob(chat_ids(front, p), SamplingParams(max_tokens=24, temperature=0.0)) for p in PROMPTS]
        solo = [alone(run, front, job)[0][0] for job in jobs]
        engine = front.client
        engine.step_sizes.clear()
        batched = [result[0][0] for result in together(run, front, jobs, stagger=0.05)]
        assert max(engine.step_sizes) >= 4, "the requests did not decode together"
        assert batched == solo

    def test_seeded_sampling_with_every_knob(self, front, run):
        knobs = [
            dict(temperature=0.9, seed=1, top_p=0.9),
            dict(temperature=1.2, seed=2, top_k=20, repetition_penalty=1.3),
            dict(temperature=0.7, seed=3, min_p=0.05, frequency_penalty=0.8, presence_penalty=0.4),
            dict(temperature=1.0, seed=4, logit_bias=((28, 4.0), (30, -100.0))),
        ]
        jobs = [
            GenerationJob(chat_ids(front, p), SamplingParams(max_tokens=20, ignore_eos=True, **k))
            for p, k in zip(PROMPTS, knobs)
        ]
        solo = [alone(run, front, job)[0][0] for job in jobs]
        batched = [result[0][0] for result in together(run, front, jobs)]
        assert batched == solo

    def test_logprobs_match(self, front, run):
        job = GenerationJob(
            chat_ids(front, PROMPTS[0]), SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=2)
        )

        async def logprobs_of(jobs):
            stream = await front.start(jobs)
            return [lp.logprob for e in [e async for e in stream] if isinstance(e, TextDelta) for lp in e.logprobs]

        solo = run(logprobs_of([job]))
        others = [
            GenerationJob(chat_ids(front, p), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
            for p in PROMPTS[1:4]
        ]

        async def mixed():
            tasks = [asyncio.ensure_future(collect(front, [o])) for o in others]
            await asyncio.sleep(0.1)
            result = await logprobs_of([job])
            await asyncio.gather(*tasks)
            return result

        batched = run(mixed())
        assert len(solo) == len(batched) == 8
        # Padded batched attention and batched matmuls reduce in another order: the last bits may differ.
        assert max(abs(a - b) for a, b in zip(solo, batched)) < 1e-3


class TestRowsJoinAndLeave:
    def test_a_short_request_leaves_while_a_long_one_runs_on(self, front, run):
        long = GenerationJob(
            chat_ids(front, PROMPTS[0]), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        )
        short = GenerationJob(
            chat_ids(front, PROMPTS[1]), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        )
        front.client.step_sizes.clear()
        (long_tokens, long_end, _), (short_tokens, short_end, _) = together(run, front, [long, short])
        assert long_end[0].completion_tokens == 40 and short_end[0].completion_tokens == 3
        sizes = front.client.step_sizes
        assert 2 in sizes and sizes[-1] == 1

    def test_n_choices_share_one_prefill_and_decode_together(self, front, run, loaded_model):
        prompt = chat_ids(front, PROMPTS[4])
        jobs = [
            GenerationJob(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True))
            for s in (1, 2, 3)
        ]
        prefills = []
        hook = loaded_model.model.register_forward_hook(
            lambda module, args, kwargs, out: prefills.append(kwargs["input_ids"].shape[1] > 1), with_kwargs=True
        )
        front.client.prefix_cache.clear()
        front.client.step_sizes.clear()
        try:
            tokens, finished, _ = run(collect(front, jobs))
        finally:
            hook.remove()
        assert sum(prefills) == 1
        assert sorted(finished) == [0, 1, 2] and front.client.step_sizes[0] == 3
        # Each choice keeps its own seed: the same as that seed alone.
        assert tokens[1] == alone(run, front, jobs[1])[0][0]

    def test_cancel_frees_the_row_and_others_go_on(self, front, run):
        async def scenario():
            long = GenerationJob(
                chat_ids(front, PROMPTS[0]), SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
            )
            other = GenerationJob(
                chat_ids(front, PROMPTS[2]), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
            )
            stream = await front.start([long])
            other_task = asyncio.ensure_future(collect(front, [other]))
            async for _ in stream:
                break  # the consumer leaves: the stream closes
            _, finished, _ = await asyncio.wait_for(other_task, timeout=60)
            await asyncio.sleep(0.5)
            return finished, front.admission.in_use

        finished, in_use = run(scenario())
        assert finished[0].completion_tokens == 10 and in_use == 0


class TestPrefixCacheUnderBatching:
    def test_kept_after_a_real_eos_ending(self, front, run):
        engine = front.client
        engine.prefix_cache.clear()
        first = chat_ids(front, "Reply with one word: yes or no?")
        tokens, finished, _ = alone(run, front, GenerationJob(first, SamplingParams(max_tokens=64, temperature=0.0)))
        end = finished[0]
        assert end.reason == "stop" and isinstance(end.stop_reason, int), "expected a real EOS ending"
        # The next turn extends the conversation: prompt + answer + more.
        follow = first + tuple(tokens[0]) + tuple(front.tokenizer("\nWhy?", add_special_tokens=False).input_ids)
        _, again, _ = alone(run, front, GenerationJob(follow, SamplingParams(max_tokens=4, temperature=0.0)))
        assert again[0].cached_tokens >= len(first) + len(tokens[0]) - 1

    def test_kept_after_a_stop_string_ending(self, front, run):
        engine = front.client
        engine.prefix_cache.clear()
        first = chat_ids(front, PROMPTS[0])
        full, _, _ = alone(
            run, front, GenerationJob(first, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        )
        stop = front.tokenizer.decode(full[0][5:7])
        _, end, _ = alone(
            run, front, GenerationJob(first, SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,)))
        )
        assert end[0].reason == "stop" and end[0].stop_reason == stop
        longer = first + (1, 2, 3)
        _, again, _ = alone(run, front, GenerationJob(longer, SamplingParams(max_tokens=2, temperature=0.0)))
        assert again[0].cached_tokens == len(first)

    def test_reuse_gives_the_same_tokens_as_a_fresh_prefill_in_a_batch(self, front, run):
        engine = front.client
        base = chat_ids(front, "Write one line about rivers and the mountains they come from.")
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        engine.prefix_cache.clear()
        alone(run, front, GenerationJob(base, params))
        longer = base + tuple(front.tokenizer(" And lakes?", add_special_tokens=False).input_ids)
        other = GenerationJob(chat_ids(front, PROMPTS[3]), SamplingParams(max_tokens=10, temperature=0.0))
        (reused, reused_end, _), _ = together(run, front, [GenerationJob(longer, params), other])
        assert reused_end[0].cached_tokens >= len(base) - 1
        engine.prefix_cache.clear()
        fresh, fresh_end, _ = alone(run, front, GenerationJob(longer, params))
        assert fresh_end[0].cached_tokens == 0 and fresh[0] == reused[0]


class TestConstraints:
    def test_each_row_follows_its_own_constraint_and_logs_under_its_request(self, loaded_model, run):
        from deltafin.engine import EngineFront

        front = EngineFront(LocalEngine(loaded_model), max_waiting=4, timeout_s=30, memo_entries=0)
        assert front.capabilities.grammar and front.capabilities.compiled_grammar
        grammars = {
            "100,200,300": AllowListGrammar([100, 200, 300], length=5),
            "400,500": AllowListGrammar([400, 500], length=5),
        }

        async def one(allowed: str, request_id: str):
            with structlog.contextvars.bound_contextvars(request_id=request_id):
                params = SamplingParams(max_tokens=50, temperature=0.8, seed=1, constraint=Constraint("test", allowed))
                return await collect(front, [GenerationJob(chat_ids(front, PROMPTS[0]), params, grammars[allowed])])

        async def scenario():
            return await asyncio.gather(one("100,200,300", "req-a"), one("400,500", "req-b"))

        (a_tokens, a_end, _), (b_tokens, b_end, _) = run(scenario())
        assert set(a_tokens[0]) <= {100, 200, 300} and set(b_tokens[0]) <= {400, 500}
        assert a_end[0].reason == b_end[0].reason == "stop" and a_end[0].completion_tokens == 5
        (a_row,) = grammars["100,200,300"].rows
        (b_row,) = grammars["400,500"].rows
        assert set(a_row.contexts) == {"req-a"} and set(b_row.contexts) == {"req-b"}

    def test_an_empty_prompt_is_a_400_not_a_crash(self, front, run):
        with pytest.raises(InvalidRequestError):
            run(collect(front, [GenerationJob((), SamplingParams(max_tokens=5))]))

    def test_a_constraint_without_its_compiled_grammar_is_a_400(self, front, run):
        # The engine never compiles: a job whose grammar was not prepared is refused, not compiled here.
        params = SamplingParams(max_tokens=5, constraint=Constraint("json_object"))
        with pytest.raises(InvalidRequestError):
            run(collect(front, [GenerationJob(chat_ids(front, PROMPTS[0]), params)]))


class TestPromptLogprobsInChunks:
    def test_chunks_bound_the_logits_and_match_a_direct_pass(self, loaded_model, run):
        from deltafin.engine import EngineFront

        front = EngineFront(LocalEngine(loaded_model, prefill_chunk=4), max_waiting=4, timeout_s=30, memo_entries=0)
        ids = tuple(front.tokenizer("The capital of France is Paris, and the capital of Italy is Rome.").input_ids)
        shapes = []
        hook = loaded_model.model.register_forward_hook(
            lambda module, args, out: shapes.append(tuple(out.logits.shape))
        )
        try:
            _, _, prompt = run(
                collect(front, [GenerationJob(ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))])
            )
        finally:
            hook.remove()
        assert len(ids) > 12 and max(shape[1] for shape in shapes) <= 4
        with torch.inference_mode():
            expected = torch.log_softmax(loaded_model.model(torch.tensor([ids])).logits[0].float(), -1)
        entries = prompt[0].logprobs
        assert entries[0] is None and len(entries) == len(ids)
        for i, entry in enumerate(entries[1:]):
            assert entry.token_id == ids[i + 1] and abs(entry.logprob - float(expected[i, ids[i + 1]])) < 1e-4
