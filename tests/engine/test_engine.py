"""The engine over the real default model: determinism, budgets, stops, cancel, memo, prefix cache."""

import asyncio
import time

import pytest

from deltafin.engine import Finished, GenerationJob, TextDelta
from deltafin.errors import InvalidRequestError
from deltafin.protocol.sampling import SamplingParams


def prompt_ids(engine, text="Tell me about the sea."):
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return tuple(ids["input_ids"] if hasattr(ids, "keys") else ids)


async def collect(engine, jobs):
    stream = await engine.start(jobs)
    texts: dict[int, str] = {}
    finished: dict[int, Finished] = {}
    async for event in stream:
        if isinstance(event, TextDelta):
            texts[event.choice] = texts.get(event.choice, "") + event.text
        else:
            finished[event.choice] = event
    return texts, finished


@pytest.fixture
def run(loop):
    return loop.run_until_complete


@pytest.fixture
def generate(engine, run):
    def generate(**params):
        job = GenerationJob(prompt_ids(engine, params.pop("text", "Tell me about the sea.")), SamplingParams(**params))
        texts, finished = run(collect(engine, [job]))
        return texts[0], finished[0]

    return generate


class TestEngine:
    def test_max_tokens_ends_with_length(self, engine, generate, run):
        text, end = generate(max_tokens=5, temperature=0.0, ignore_eos=True)
        assert end.reason == "length" and end.completion_tokens == 5 and text

    def test_a_job_past_the_context_is_refused_not_cut(self, engine, run):
        """Serving sizes each job to the context (deltafin.serving.plan); the engine never cuts one silently."""
        ids = prompt_ids(engine)
        job = GenerationJob(ids, SamplingParams(max_tokens=engine.context_length - len(ids) + 1, temperature=0.0))
        with pytest.raises(InvalidRequestError, match="do not fit"):
            run(collect(engine, [job]))

    def test_greedy_is_repeatable_without_the_memo(self, engine, generate, run):
        engine.memo._items.clear()
        first, _ = generate(max_tokens=12, temperature=0.0)
        engine.memo._items.clear()
        second, _ = generate(max_tokens=12, temperature=0.0)
        assert first == second

    def test_seeded_sampling_is_repeatable_and_seed_dependent(self, engine, generate, run):
        engine.memo._items.clear()
        a, _ = generate(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
        engine.memo._items.clear()
        b, _ = generate(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
        c, _ = generate(max_tokens=16, temperature=1.0, seed=12, ignore_eos=True)
        assert a == b and a != c

    def test_stop_string_cuts_the_text(self, engine, generate, run):
        full, _ = generate(max_tokens=20, temperature=0.0, ignore_eos=True)
        stop = full.split()[2]
        text, end = generate(max_tokens=20, temperature=0.0, ignore_eos=True, stop=(stop,))
        assert end.reason == "stop" and end.stop_reason == stop
        assert text == full[: full.index(stop)]

    def test_memo_replays_without_the_model(self, engine, generate, run, monkeypatch):
        engine.memo._items.clear()
        first, end1 = generate(max_tokens=10, temperature=0.0, text="Name a colour.")
        submitted = []
        submit = engine.client.submit
        monkeypatch.setattr(
            engine.client, "submit", lambda jobs, stream: (submitted.append(jobs), submit(jobs, stream))
        )
        second, end2 = generate(max_tokens=10, temperature=0.0, text="Name a colour.")
        assert second == first and end2.memo_hit and not end1.memo_hit
        assert submitted == []  # replayed by the front: the engine never saw the request

    def test_unseeded_sampling_is_not_memoized(self, engine, generate, run):
        engine.memo._items.clear()
        generate(max_tokens=3, temperature=1.0)
        assert len(engine.memo) == 0

    def test_prefix_cache_reuses_and_matches_a_fresh_run(self, engine, generate, run):
        engine.memo._items.clear()
        engine.client.prefix_cache.clear()
        base = prompt_ids(engine, "Write one line about rivers and the mountains they come from.")
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        run(collect(engine, [GenerationJob(base, params)]))
        longer = base + tuple(engine.tokenizer(" And lakes?", add_special_tokens=False).input_ids)
        texts, finished = run(collect(engine, [GenerationJob(longer, params)]))
        assert finished[0].cached_tokens >= len(base) - 1
        engine.memo._items.clear()
        engine.client.prefix_cache.clear()
        fresh_texts, fresh = run(collect(engine, [GenerationJob(longer, params)]))
        assert fresh[0].cached_tokens == 0 and fresh_texts[0] == texts[0]

    def test_closing_the_stream_frees_the_engine_at_the_next_token(self, engine, generate, run):
        async def scenario():
            job = GenerationJob(prompt_ids(engine), SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True))
            stream = await engine.start([job])
            async for _event in stream:
                break  # the consumer leaves after the first event
            started = time.perf_counter()
            await asyncio.wait_for(engine.admission.acquire(), timeout=30)
            engine.admission.release()
            return time.perf_counter() - started

        # Generous: freed at the next token is milliseconds; the 4000 tokens the job had left take minutes on the
        # CPU, so 10 s tells the two apart even on a loaded machine.
        assert run(scenario()) < 10

    def test_n_choices_arrive_in_order(self, engine, generate, run):
        jobs = [
            GenerationJob(prompt_ids(engine), SamplingParams(max_tokens=4, temperature=1.0, seed=s, ignore_eos=True))
            for s in (1, 2)
        ]
        texts, finished = run(collect(engine, jobs))
        assert sorted(finished) == [0, 1] and all(f.completion_tokens == 4 for f in finished.values())

    @pytest.mark.parametrize("max_tokens", [1, 3])
    def test_budget_is_exact(self, engine, generate, run, max_tokens):
        _, end = generate(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        assert end.completion_tokens == max_tokens


class TestPromptLogprobs:
    def test_match_a_direct_forward_pass(self, engine, run):
        import torch

        from deltafin.engine import PromptLogprobs

        ids = tuple(engine.tokenizer("The capital of France is Paris").input_ids)
        job = GenerationJob(ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))

        async def events():
            return [e async for e in await engine.start([job])]

        (prompt,) = [e for e in run(events()) if isinstance(e, PromptLogprobs)]
        with torch.inference_mode():
            expected = torch.log_softmax(engine.client.model(torch.tensor([ids])).logits[0].float(), -1)
        assert prompt.token_ids == ids and prompt.logprobs[0] is None
        for i, entry in enumerate(prompt.logprobs[1:]):
            assert abs(entry.logprob - float(expected[i, ids[i + 1]])) < 1e-4
            assert len(entry.top) == 2
