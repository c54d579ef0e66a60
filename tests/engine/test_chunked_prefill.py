"""Chunked prefill in the local engine (engine.prefill_chunk_tokens), on the real default model: a long prompt
is prefilled a chunk at a time between decode steps of the running rows, with the same output as one pass."""

from __future__ import annotations

import asyncio

import pytest

from deltafin.engine import EngineFront, Finished, GenerationJob, TextDelta
from deltafin.engine.local.engine import LocalEngine
from deltafin.protocol.sampling import SamplingParams
from tests.engine.test_batching import chat_ids, collect

CHUNK = 48
STORY = (
    "The lighthouse keeper climbed the stairs every evening, counting the steps and listening to the sea. "
    "Ships passed far out, their lights small and steady, and the keeper wrote each one in a book. "
)


def front_with(loaded_model, chunk: int, **kwargs) -> EngineFront:
    return EngineFront(
        LocalEngine(loaded_model, prefill_chunk=chunk, **kwargs), max_waiting=16, timeout_s=120, memo_entries=0
    )


@pytest.fixture(scope="module")
def chunked(loaded_model):
    return front_with(loaded_model, CHUNK)


@pytest.fixture(scope="module")
def whole(loaded_model):
    return front_with(loaded_model, 8192)  # every prompt here in one forward pass


@pytest.fixture
def run(loop):
    return loop.run_until_complete


def long_prompt(front, repeats: int = 8) -> tuple[int, ...]:
    return chat_ids(front, "Summarise this story in one line: " + STORY * repeats)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


class TestSameOutputAsOnePass:
    def test_greedy_tokens_and_logprobs_match(self, chunked, whole, run):
        ids = long_prompt(chunked)
        assert len(ids) > 6 * CHUNK
        params = greedy(12, logprobs=True, top_logprobs=2)
        chunked.client.prefix_cache.clear()
        whole.client.prefix_cache.clear()
        a_tokens, a_end, _ = run(collect(chunked, [GenerationJob(ids, params)]))
        b_tokens, b_end, _ = run(collect(whole, [GenerationJob(ids, params)]))
        assert a_tokens[0] == b_tokens[0]
        assert a_end[0].prompt_tokens == b_end[0].prompt_tokens == len(ids)

    def test_prompt_logprobs_match(self, chunked, whole, run):
        ids = long_prompt(chunked, repeats=3)
        params = greedy(2, prompt_logprobs=1)
        _, _, a = run(collect(chunked, [GenerationJob(ids, params)]))
        _, _, b = run(collect(whole, [GenerationJob(ids, params)]))
        a_entries, b_entries = a[0].logprobs, b[0].logprobs
        assert len(a_entries) == len(b_entries) == len(ids) and a_entries[0] is None
        for x, y in zip(a_entries[1:], b_entries[1:]):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-3

    def test_a_prefix_cache_hit_then_chunks_matches_one_pass(self, chunked, whole, run):
        base = long_prompt(chunked, repeats=4)
        longer = base + tuple(chunked.tokenizer(" And then? " + STORY * 3, add_special_tokens=False).input_ids)
        chunked.client.prefix_cache.clear()
        run(collect(chunked, [GenerationJob(base, greedy(2))]))  # leaves base's cache behind
        reused, reused_end, _ = run(collect(chunked, [GenerationJob(longer, greedy(10))]))
        assert reused_end[0].cached_tokens >= len(base) - 1 and len(longer) - len(base) > CHUNK
        whole.client.prefix_cache.clear()
        fresh, fresh_end, _ = run(collect(whole, [GenerationJob(longer, greedy(10))]))
        assert fresh_end[0].cached_tokens == 0 and fresh[0] == reused[0]


class TestInterleaving:
    def test_a_long_prompt_is_prefilled_between_decode_steps_of_a_running_stream(self, chunked, run):
        engine = chunked.client
        engine.prefix_cache.clear()
        running = GenerationJob(chat_ids(chunked, "Count to fifty."), greedy(400))
        arriving = GenerationJob(long_prompt(chunked), greedy(2))

        async def scenario():
            stream = await chunked.start([running])
            events = stream.__aiter__()  # held, not left: leaving the iteration would close the stream
            seen = 0
            while seen < 3:  # the stream is decoding
                event = await events.__anext__()
                seen += isinstance(event, TextDelta) and bool(event.token_ids)
            engine.schedule.clear()
            result = await collect(chunked, [arriving])
            schedule = list(engine.schedule)
            await events.aclose()
            return result, schedule

        (_, finished, _), schedule = run(scenario())
        assert finished[0].prompt_tokens == len(arriving.prompt_ids)
        windows = [i for i, (what, _) in enumerate(schedule) if what == "prefill"]
        assert all(n <= CHUNK for what, n in schedule if what == "prefill")
        assert sum(n for what, n in schedule if what == "prefill") >= len(arriving.prompt_ids) - CHUNK
        # Event order: between the first and the last window of the long prompt, a decode step after each one.
        between = schedule[windows[0] : windows[-1] + 1]
        steps = [what for what, _ in between].count("step")
        assert steps >= len(windows) - 1, schedule

    def test_prompts_in_prefill_take_turns(self, chunked, run):
        engine = chunked.client
        engine.prefix_cache.clear()
        longs = [GenerationJob(long_prompt(chunked, repeats=r), greedy(1)) for r in (7, 8)]
        short = GenerationJob(chat_ids(chunked, "Hi"), greedy(1))
        order: list[str] = []

        async def one(name: str, job: GenerationJob):
            await collect(chunked, [job])
            order.append(name)

        async def scenario():
            # Both long prompts arrive first; the short one right after, while they are in prefill.
            tasks = [asyncio.ensure_future(one(f"long{i}", job)) for i, job in enumerate(longs)]
            await asyncio.sleep(0.05)
            tasks.append(asyncio.ensure_future(one("short", short)))
            await asyncio.gather(*tasks)

        run(scenario())
        # Round-robin: the short prompt does not wait for either long prefill to finish.
        assert order[0] == "short", order


class TestCancelMidPrefill:
    def test_cancelling_frees_everything_and_leaves_no_partial_cache(self, loaded_model, run):
        front = front_with(loaded_model, 16)  # many small windows: the cancel lands mid-prefill
        engine = front.client
        ids = long_prompt(front)
        windows = []
        hook = loaded_model.model.register_forward_hook(
            lambda module, args, kwargs, out: windows.append(kwargs["input_ids"].shape[1]), with_kwargs=True
        )

        async def scenario():
            stream = await front.start([GenerationJob(ids, greedy(4))])
            while len(windows) < 3:
                await asyncio.sleep(0.01)
            stream.close()
            events = [event async for event in stream]
            for _ in range(100):
                if front.admission.in_use == 0 and not engine._prefilling:
                    break
                await asyncio.sleep(0.02)
            return events

        try:
            events = run(scenario())
        finally:
            hook.remove()
        assert not any(isinstance(event, Finished) for event in events)
        assert front.admission.in_use == 0 and not engine._prefilling and not engine._rows
        assert sum(windows) < len(ids)  # it really stopped part-way
        # Nothing partial was offered to the prefix cache: the same prompt is prefilled from scratch.
        _, finished, _ = run(collect(front, [GenerationJob(ids, greedy(1))]))
        assert finished[0].cached_tokens == 0
        run(front.aclose())


class TestAdmissionByTokens:
    def test_a_short_request_starts_while_long_prompts_prefill(self, loaded_model, run):
        """Two long prompts and two rows: the second long prompt waits for the first's prefill, the short request
        takes the row it would have held and answers before either long prompt is prefilled. Before, the long
        prompts held both rows through their prefill and the short request waited for one of them to end."""
        front = EngineFront(
            LocalEngine(loaded_model, prefill_chunk=CHUNK, max_batch=2),
            max_waiting=16,
            timeout_s=120,
            memo_entries=0,
            long_prefill_tokens=256,
            max_long_prefills=1,
        )
        front.client.prefix_cache.clear()
        longs = [GenerationJob(long_prompt(front, repeats=r), greedy(1)) for r in (9, 10)]
        assert all(len(job.prompt_ids) >= 256 for job in longs)
        short = GenerationJob(chat_ids(front, "Hi"), greedy(1))
        order: list[str] = []

        async def one(name: str, job: GenerationJob):
            await collect(front, [job])
            order.append(name)

        async def scenario():
            tasks = [asyncio.ensure_future(one(f"long{i}", job)) for i, job in enumerate(longs)]
            await asyncio.sleep(0.05)
            tasks.append(asyncio.ensure_future(one("short", short)))
            await asyncio.gather(*tasks)

        run(scenario())
        assert order[0] == "short", order
        assert front.admission.in_use == 0 and front.admission.waiting == 0
