"""The local engine holds each row to its own thinking budget: rows of one batch with different budgets, on the
tiny Kimi K2 (random weights: it never ends reasoning by itself), each write exactly their budget of reasoning
tokens, then the forced `</think>`, then go on; and a tiny model taught to reason at length then answer answers,
after the forced end, with the answer it was taught."""

from __future__ import annotations

import asyncio

import pytest

from deltafin.engine import EngineFront, Finished, GenerationJob, TextDelta
from deltafin.engine.local.engine import LocalEngine
from deltafin.engine.weights.loader import load_model
from deltafin.protocol.sampling import ReasoningBudget, SamplingParams
from deltafin.tiny import write_tiny_model
from deltafin.tiny.taught import taught
from tests.conftest import tiny_config
from tests.e2e.test_families import QUESTION, TOOLS, render

END = "</think>"


@pytest.fixture(scope="module")
def k2(tiny_models):
    config = tiny_config("kimi_k2", tiny_models["kimi_k2"])
    return load_model(config.model, config.placement), tuple(render("kimi_k2", tiny_models["kimi_k2"], QUESTION))


def budget(tokenizer, tokens: int) -> ReasoningBudget:
    forced = tuple(tokenizer(END, add_special_tokens=False).input_ids)
    return ReasoningBudget(tokens=tokens, ends=(END,), forced=forced, forced_text=END, opened="<think>")


def run(loaded, jobs: list[GenerationJob]) -> tuple[dict[int, list[int]], dict[int, Finished], LocalEngine]:
    engine = LocalEngine(loaded, max_batch=8)
    front = EngineFront(engine, max_waiting=1, timeout_s=60, memo_entries=0)

    async def go():
        ids: dict[int, list[int]] = {}
        ends: dict[int, Finished] = {}
        async for event in await front.start(jobs):
            if isinstance(event, TextDelta):
                ids.setdefault(event.choice, []).extend(event.token_ids)
            elif isinstance(event, Finished):
                ends[event.choice] = event
        await front.aclose()
        return ids, ends

    ids, ends = asyncio.run(go())
    return ids, ends, engine


def test_rows_of_one_batch_each_keep_their_own_budget(k2):
    loaded, prompt = k2
    end_id = loaded.tokenizer.convert_tokens_to_ids(END)
    budgets = [0, 2, 5, 9]
    jobs = [
        GenerationJob(
            prompt,
            SamplingParams(max_tokens=20, temperature=1.0, seed=seed, reasoning_budget=budget(loaded.tokenizer, b)),
        )
        for seed, b in enumerate(budgets)
    ]
    free = GenerationJob(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=99))
    ids, ends, engine = run(loaded, [*jobs, free])
    assert max(engine.step_sizes) == len(budgets) + 1  # one batch
    for choice, b in enumerate(budgets):
        assert ids[choice].index(end_id) == b, (b, ids[choice])
        assert ends[choice].reasoning_tokens == b and len(ids[choice]) > b + 1
    assert end_id not in ids[len(budgets)] and ends[len(budgets)].reasoning_tokens is None


def test_a_taught_model_answers_after_the_forced_end(tmp_path):
    """Taught to reason for 24 tokens, then answer; also taught the answer after reasoning cut short anywhere
    (what a budget makes of its reasoning), as a model trained with budgets is."""
    fresh = write_tiny_model("kimi_k2", tmp_path / "model")
    config = tiny_config("kimi_k2", fresh)
    prompt = render("kimi_k2", fresh, QUESTION)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fresh)
    thought = " Paris is in France and the sky there is clear today so it is sunny" * 2
    answer = "Sunny in Paris.<|im_end|>"
    thought_ids = tokenizer(thought, add_special_tokens=False).input_ids
    end = tokenizer(END, add_special_tokens=False).input_ids
    cuts = [(prompt + thought_ids[:k] + end, answer) for k in (0, 2, 4, 6, 9, 13)]
    path = taught(fresh, [(prompt, thought + END + answer), *cuts], lr=3e-3, steps=800)
    loaded = load_model(tiny_config("kimi_k2", path).model, config.placement)
    stop = loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    jobs = [
        GenerationJob(tuple(prompt), SamplingParams(max_tokens=60, temperature=0.0, reasoning_budget=b))
        for b in (budget(loaded.tokenizer, 4), budget(loaded.tokenizer, 11), None)
    ]
    ids, ends, _ = run(loaded, jobs)
    for choice, b in enumerate((4, 11)):
        text = loaded.tokenizer.decode(ids[choice], skip_special_tokens=False)
        reasoning, _, after = text.partition(END)
        assert ends[choice].reasoning_tokens == b and ids[choice][:b] == thought_ids[:b]
        assert after == answer and ids[choice][-1] == stop, text  # the answer, then the end of the turn
    unbudgeted = loaded.tokenizer.decode(ids[2], skip_special_tokens=False)
    assert unbudgeted.startswith(thought + END) and ends[2].reasoning_tokens is None
    # The same through the chat API (the prompt it was taught: with the tools declared): the reasoning cut at the
    # budget, the taught answer as the content.
    from litestar.testing import TestClient

    from deltafin.app import build_app
    from deltafin.app.services import Services

    served = tiny_config("kimi_k2", path, ["server.memo.entries=0"])
    with TestClient(build_app(served, Services.load(served))) as client:
        body = {"messages": QUESTION, "tools": TOOLS, "thinking_token_budget": 6, "temperature": 0, "max_tokens": 60}
        answer = client.post("/v1/chat/completions", json=body).json()
    message = answer["choices"][0]["message"]
    assert message["reasoning_content"] == tokenizer.decode(thought_ids[:6]) and message["content"] == "Sunny in Paris."
    assert answer["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6
