"""The GBNF Deltafin sends to llama-server, against the real binary: every family's forced-call grammar (named
and required, one and two tools, reasoning enabled / disabled / auto) parses; control tokens given as ids are
matched as those tokens; and a constrained greedy generation with the default SmolLM2 GGUF is text the
family's own parser reads as the forced call, with arguments inside the schema. SmolLM2 has none of the
families' markers as tokens: it spells them, which is what a grammar without token ids allows.
The llama-server and the gateway are the tier's (tests/gateway/llama_tier.py): the gateway test's model is one
entry of that gateway.
Skipped unless `scripts/build-llama-server` has built the binary (or DELTAFIN_LLAMA_SERVER names one)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from deltafin.engine.upstream.llama_server import added_tokens
from deltafin.engine.weights.tokenizer_only import load_tokenizer_only
from deltafin.grammar.gbnf import structural_tag_to_gbnf
from deltafin.markup import formats as f
from deltafin.markup.selection import forced_calls
from deltafin.testing.llama_server import llama_server_binary
from tests.conftest import compose_config
from tests.gateway.llama_tier import SMOLLM2, gateway_model
from tests.grammar.tools import NAMED, TIME, WEATHER
from tests.markup.test_gbnf_families import SYNTAXES, special_tokens
from tests.markup.test_tool_calls import parse, tools_for_parser
from tests.tiers import unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.llama_server]

if not llama_server_binary().exists():
    unavailable("llama_server", f"llama-server not built ({llama_server_binary()}); run scripts/build-llama-server")

MODES = {
    "named": ([WEATHER, TIME], NAMED, None),
    "required": ([WEATHER, TIME], "required", None),
    "one-call": ([WEATHER, TIME], "required", False),
}
#: where the family's output starts when the prompt closed reasoning (K3: inside the response channel it opened)
PROMPT_END = {"kimi_k3": "<|open|>response<|sep|>"}
#: SmolLM2's GGUF served under the qwen3 family (test_a_forced_call_through_the_gateway)
QWEN3 = gateway_model(
    "llama-smollm2-qwen3", SMOLLM2, ["engine.max_inflight=1", "model.family=qwen3", "model.context_length=2048"]
).name


@pytest.fixture(scope="module")
def llama(llama_tier):
    """The default SmolLM2 GGUF in llama-server (slots of 2048 tokens)."""
    return llama_tier.url(SMOLLM2)


def complete(url: str, grammar: str, prompt: str | list[int], n_predict: int) -> httpx.Response:
    return httpx.post(
        f"{url}/completion",
        timeout=600,
        json={
            "prompt": prompt,
            "grammar": grammar,
            "n_predict": n_predict,
            "temperature": 0,
            "return_tokens": True,
            "samplers": ["temperature"],
            "cache_prompt": False,
        },
    )


def test_a_malformed_grammar_is_refused_so_acceptance_means_something(llama):
    response = complete(llama, 'root ::= "x" (', "Hi", 1)
    assert response.status_code == 400 and "grammar" in response.text


@pytest.mark.parametrize("with_token_ids", [False, True])
@pytest.mark.parametrize("reasoning", ["enabled", "disabled", "auto"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(SYNTAXES))
def test_every_family_grammar_is_accepted(llama, family, mode, reasoning, with_token_ids):
    """With token ids: the family's markers as made-up SmolLM2 ids, which is all the grammar parser checks."""
    tools, choice, parallel = MODES[mode]
    tag = SYNTAXES[family].calls(forced_calls(tools, choice, parallel_tool_calls=parallel), reasoning)
    grammar = structural_tag_to_gbnf(tag, special_tokens(family) if with_token_ids else None)
    response = complete(llama, grammar, "Hi", 1)
    assert response.status_code == 200, response.text
    assert len(response.json()["tokens"]) == 1, response.text  # the grammar was read and constrained one token


@pytest.mark.parametrize("family", ["kimi_k3", "glm47"])
def test_a_large_toolset_is_accepted_and_answers_quickly(llama, family):
    """Thirty tools of nested arguments with markers as token ids: the grammar parses, and one constrained
    token comes back within seconds (the markers' text automata are shared, not one per string argument)."""
    schema = {
        "type": "object",
        "properties": {
            "q": {"type": "string"},
            "n": {"type": "integer", "minimum": 1, "maximum": 500},
            "opts": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"k": {"type": "string"}, "v": {"anyOf": [{"type": "number"}, {"type": "null"}]}},
                },
            },
            "mode": {"enum": ["fast", "slow"]},
        },
        "required": ["q"],
    }
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": schema}} for i in range(30)]
    grammar = structural_tag_to_gbnf(
        SYNTAXES[family].calls(forced_calls(tools, "required"), "enabled"), special_tokens(family)
    )
    started = time.monotonic()
    response = complete(llama, grammar, "Hi", 1)
    assert response.status_code == 200, response.text
    assert len(response.json()["tokens"]) == 1, response.text  # the one constrained token asked for
    # Generous (one token comes back within seconds): a grammar that blew up per string argument would not
    # answer within a minute.
    assert time.monotonic() - started < 60


def test_added_tokens_are_matched_by_id(llama):
    bundle = load_tokenizer_only(compose_config().model)
    specials = added_tokens(bundle.tokenizer, bundle.stop_token_ids)
    assert "<|im_end|>" not in specials  # SmolLM2's end of generation: see added_tokens
    start, sep = specials["<|im_start|>"], specials["<file_sep>"]
    grammar = structural_tag_to_gbnf(f.structural_tag(f.const("<|im_start|>ok<file_sep>")), specials)
    assert f"<[{start}]>" in grammar and f"<[{sep}]>" in grammar
    response = complete(llama, grammar, "Hi", 8)
    assert response.status_code == 200, response.text
    tokens = response.json()["tokens"]
    assert tokens[0] == start and sep in tokens and bundle.tokenizer.decode(tokens[1 : tokens.index(sep)]) == "ok"


@pytest.mark.parametrize("family", list(SYNTAXES))
def test_constrained_generation_is_the_forced_call(llama, family):
    grammar = structural_tag_to_gbnf(SYNTAXES[family].calls(forced_calls([WEATHER, TIME], NAMED), "disabled"))
    prompt = "What is the weather in Rome for the next 3 days? Answer with a get_weather tool call.\n"
    response = complete(llama, grammar, prompt, 320)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["stop_type"] == "eos", body["content"]  # the grammar completed; only end-of-generation was left
    parsed = parse(family, body["content"], PROMPT_END.get(family, ""), tools_for_parser([WEATHER, TIME]))
    assert [c["name"] for c in parsed["calls"]] == ["get_weather"], body["content"]
    args = json.loads(parsed["calls"][0]["arguments"])
    assert set(args) == {"city", "days"} and args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7, args


def test_a_forced_call_through_the_gateway(llama_tier):
    """The whole path with the openai client: Deltafin (engine=llama_server) serves SmolLM2's GGUF under the
    qwen3 family (ChatML like SmolLM2, Hermes tool calls), so a named tool_choice becomes a structural tag,
    GBNF upstream, and a parsed tool call in the response."""
    import openai

    client = openai.OpenAI(base_url=f"{llama_tier.gateway.base_url}/v1", api_key="x", max_retries=0, timeout=600)
    messages = [{"role": "user", "content": "Weather in Rome for 3 days?"}]
    reply = client.chat.completions.create(
        model=QWEN3, messages=messages, max_tokens=200, temperature=0, tools=[WEATHER, TIME], tool_choice=NAMED
    )
    # xgrammar takes (and ignores) `not`; the GBNF translation refuses it: a 400 naming tools, not a 500
    odd = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"not": {"type": "integer"}}}},
        },
    }
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=QWEN3, messages=messages, max_tokens=20, tools=[odd], tool_choice="required"
        )
    assert refused.value.body["param"] == "tools" and "'not'" in refused.value.body["message"]
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7
