"""A thinking budget in front of an upstream, against fake upstreams (tests/gateway's real vLLM and llama-server
tiers run it against the real engines): the ids an upstream sends are held to the budget, and a generation that
would write a reasoning token past it is stopped there and resumed with the end of reasoning forced; an upstream
that has a budget of its own gets it (vLLM's `thinking_token_budget`, llama-server's `reasoning_budget_*`), and
a vLLM that refuses the field is asked again without it, Deltafin holding the budget."""

from __future__ import annotations

import asyncio

import pytest

from deltafin.engine import GenerationJob
from deltafin.engine.upstream.llama_server import LlamaServerAdapter
from deltafin.engine.upstream.sglang import SglangAdapter
from deltafin.engine.upstream.vllm import VllmAdapter
from deltafin.engine.weights.tokenizer_only import load_tokenizer_only
from deltafin.grammar.constraints import json_schema
from deltafin.protocol.sampling import ReasoningBudget, SamplingParams
from deltafin.testing.upstream_fakes import Fake, ScriptedBody, collect, make_front
from tests.conftest import tiny_config

PROMPT = (5, 6, 7, 8)


@pytest.fixture(scope="module")
def k2(tiny_models):
    """The tiny Kimi K2's tokenizer: `<think>`, `</think>` are tokens of its vocabulary."""
    return load_tokenizer_only(tiny_config("kimi_k2", tiny_models["kimi_k2"]).model)


def ids(bundle, text: str) -> list[int]:
    return bundle.tokenizer(text, add_special_tokens=False).input_ids


def test_the_words_here_are_one_token_each(k2):
    """The counts below are token counts: each repeated word is one token of the tiny vocabulary."""
    assert all(len(ids(k2, word)) == 1 for word in (" step", " a", " b", " c", "x", "z", "</think>"))


def budget(bundle, tokens: int, **extra) -> ReasoningBudget:
    return ReasoningBudget(
        tokens=tokens,
        ends=("</think>",),
        forced=tuple(ids(bundle, "</think>")),
        forced_text="</think>",
        opened="<think>",
        **extra,
    )


def job(bundle, tokens: int, *, max_tokens: int = 40, **params) -> GenerationJob:
    return GenerationJob(
        PROMPT,
        SamplingParams(max_tokens=max_tokens, temperature=0.0, reasoning_budget=budget(bundle, tokens), **params),
    )


def sglang_events(out_ids: list[int], finish: dict | None) -> list[dict]:
    """Incremental SGLang events, one id each; the last carries `finish`."""
    return [
        {
            "text": "",
            "output_ids": [token],
            "meta_info": {
                "id": "r",
                "prompt_tokens": len(PROMPT),
                "completion_tokens": n + 1,
                "cached_tokens": 0,
                "finish_reason": finish if n == len(out_ids) - 1 else None,
            },
        }
        for n, token in enumerate(out_ids)
    ]


class TestStopAndResume:
    """SGLang has no budget of its own: Deltafin's watch is the budget."""

    def test_reasoning_past_the_budget_is_stopped_and_resumed_with_the_end_forced(self, k2):
        thinking = ids(k2, " step") * 30  # an upstream that would reason on and on
        answer = ids(k2, " Paris")

        def respond(body, path):
            if len(body["input_ids"]) == len(PROMPT):
                return ScriptedBody(sglang_events(thinking, {"type": "length"}), delay=0.01)
            return ScriptedBody(sglang_events(answer, {"type": "stop", "matched": 0}))

        fake = Fake(respond)
        out = asyncio.run(collect(make_front(SglangAdapter, k2, fake), job(k2, 4)))
        end = ids(k2, "</think>")
        assert out.ids == [*thinking[:4], *end, *answer]
        assert out.text == " step" * 4 + "</think> Paris"
        assert out.finished.reasoning_tokens == 4 and out.finished.completion_tokens == 4 + len(end) + len(answer)
        assert out.finished.prompt_tokens == len(PROMPT) and out.finished.reason == "stop"
        (_, first), (_, second) = fake.requests
        assert second["input_ids"] == [*PROMPT, *thinking[:4], *end]
        assert second["sampling_params"]["max_new_tokens"] == 40 - 4 - len(end)
        assert first["rid"] != second["rid"]
        assert fake.bodies[0].closed_early  # the first upstream request was closed where the budget stopped it

    def test_a_resumed_constrained_generation_continues_under_the_constraint_after_reasoning(self, k2):
        after = json_schema({"type": "object"})
        constrained = GenerationJob(
            PROMPT,
            SamplingParams(
                max_tokens=40,
                temperature=0.0,
                constraint=json_schema({"type": "string"}),  # stands for "reasoning, then the answer"
                reasoning_budget=budget(k2, 2, resume=after),
            ),
        )

        def respond(body, path):
            if len(body["input_ids"]) == len(PROMPT):
                return ScriptedBody(sglang_events(ids(k2, " a") * 9, {"type": "length"}))
            return ScriptedBody(sglang_events(ids(k2, "{}"), {"type": "stop", "matched": 0}))

        fake = Fake(respond)
        asyncio.run(collect(make_front(SglangAdapter, k2, fake), constrained))
        (_, first), (_, second) = fake.requests
        assert first["sampling_params"]["json_schema"] == '{"type":"string"}'
        assert second["sampling_params"]["json_schema"] == '{"type":"object"}'

    def test_a_forced_end_that_uses_the_last_of_max_tokens_ends_the_choice_there(self, k2):
        fake = Fake(lambda body, path: ScriptedBody(sglang_events(ids(k2, " b") * 20, {"type": "length"})))
        out = asyncio.run(collect(make_front(SglangAdapter, k2, fake), job(k2, 3, max_tokens=4)))
        assert out.ids == [*ids(k2, " b") * 3, *ids(k2, "</think>")]
        assert out.finished.reason == "length" and out.finished.reasoning_tokens == 3
        assert len(fake.requests) == 1

    def test_an_upstream_that_ends_reasoning_in_time_is_never_resumed(self, k2):
        within = [*ids(k2, " c") * 2, *ids(k2, "</think>"), *ids(k2, " done")]
        fake = Fake(lambda body, path: ScriptedBody(sglang_events(within, {"type": "stop", "matched": 0})))
        out = asyncio.run(collect(make_front(SglangAdapter, k2, fake), job(k2, 5)))
        assert out.ids == within and out.finished.reasoning_tokens == 2 and len(fake.requests) == 1


def vllm_events(out_ids: list[int], finish: str) -> list[dict]:
    return [
        {"choices": [{"token_ids": [token], "finish_reason": finish if n == len(out_ids) - 1 else None}]}
        for n, token in enumerate(out_ids)
    ]


class TestVllm:
    def test_the_budget_goes_as_vllms_own_and_its_forced_end_is_taken_as_is(self, k2):
        held = [*ids(k2, "x") * 3, *ids(k2, "</think>"), *ids(k2, " y")]  # vLLM forced the end at 3
        fake = Fake(lambda body, path: ScriptedBody(vllm_events(held, "stop")))
        out = asyncio.run(collect(make_front(VllmAdapter, k2, fake), job(k2, 3)))
        assert out.ids == held and out.finished.reasoning_tokens == 3
        [(path, body)] = fake.requests
        assert path == "/inference/v1/generate" and body["sampling_params"]["thinking_token_budget"] == 3

    @pytest.mark.parametrize("in_stream", [False, True], ids=["status", "in-stream"])
    def test_a_vllm_without_a_reasoning_parser_is_asked_again_without_it(self, k2, in_stream):
        """vLLM refuses with a 400, or (its generate endpoint) with an error event inside a 200 stream."""
        refusal = {
            "error": {
                "message": "thinking_token_budget is set but reasoning_config is not configured. "
                "Please set --reasoning-config to use thinking_token_budget.",
                "type": "BadRequestError",
            }
        }

        def respond(body, path):
            if "thinking_token_budget" in body["sampling_params"]:
                return ScriptedBody([refusal]) if in_stream else (400, refusal)
            if len(body["token_ids"]) == len(PROMPT):
                return ScriptedBody(vllm_events(ids(k2, "z") * 10, "length"))
            return ScriptedBody(vllm_events(ids(k2, " ok"), "stop"))

        fake = Fake(respond)
        front = make_front(VllmAdapter, k2, fake)
        out = asyncio.run(collect(front, job(k2, 2)))
        assert out.ids == [*ids(k2, "z") * 2, *ids(k2, "</think>"), *ids(k2, " ok")]
        assert out.finished.reasoning_tokens == 2
        assert [("thinking_token_budget" in body["sampling_params"]) for _, body in fake.requests] == [
            True,
            False,
            False,
        ]
        assert front.client.adapter.native_budget is False  # later requests go without it at once


def test_llama_server_gets_its_own_budget_fields(k2):
    path, body = LlamaServerAdapter(_settings()).request(job(k2, 7), "r", frozenset())
    assert path == "/completion"
    assert body["reasoning_budget_tokens"] == 7
    assert body["reasoning_budget_start_tag"] == "<think>" and body["generation_prompt"] == "<think>"
    assert body["reasoning_budget_end_tags"][0] == "</think>" and body["reasoning_budget_message"] == ""


def test_a_budget_the_model_may_open_itself_starts_at_its_start_tag(k2):
    auto = GenerationJob(
        PROMPT,
        SamplingParams(
            max_tokens=9,
            reasoning_budget=ReasoningBudget(
                tokens=3, ends=("</think>",), forced=(1,), forced_text="</think>", start="<think>"
            ),
        ),
    )
    _, body = LlamaServerAdapter(_settings()).request(auto, "r", frozenset())
    assert body["reasoning_budget_start_tag"] == "<think>" and "generation_prompt" not in body


def _settings():
    from deltafin.engine.upstream.engine import UpstreamSettings

    return UpstreamSettings(url="http://upstream.test:8000")
