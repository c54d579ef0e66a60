"""Renders kept by conversation shape (deltafin.prompt.chat_format.RenderCache): a cached render is the render,
byte for byte, for every family's Jinja template; what the template may see differently is never shared."""

import pytest
from transformers import AutoTokenizer

from deltafin.prompt import build_chat_format
from deltafin.prompt.chat_format import RenderCache
from deltafin.protocol.chat import ChatMessage, FunctionCall, TextPart, ToolCall, ToolDefinition, FunctionDefinition
from tests.conftest import tiny_config

TEMPLATE_FAMILIES = ["glm45", "glm47", "kimi_k2", "qwen3"]


def formats(family, tiny_models):
    """(cached, uncached) chat formats of one tiny model."""
    config = tiny_config(family, tiny_models[family])
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[family])

    def build():
        return build_chat_format(config.model.chat_format, tokenizer, content_format=config.model.content_format,
                                 default_kwargs=dict(config.model.chat_template_kwargs))

    cached, uncached = build(), build()
    assert cached._renders is not None
    uncached._renders = None
    return cached, uncached


def tool(name):
    return ToolDefinition(function=FunctionDefinition(name=name, parameters={"type": "object", "properties": {"q": {"type": "string"}}}))


def call(arguments):
    return ToolCall(id="call_0", function=FunctionCall("search", arguments))


# Pairs of conversations of one shape but different texts, then conversations that differ in what the template
# sees (roles, tool calls' arguments, reasoning present or not, text parts).
CONVERSATIONS = [
    [ChatMessage(role="user", content="Hello there")],
    [ChatMessage(role="user", content="Something else entirely, longer <|im_start|>")],
    [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi")],
    [ChatMessage(role="system", content="Be long."), ChatMessage(role="user", content="Bye")],
    [ChatMessage(role="user", content="q"), ChatMessage(role="assistant", content="", tool_calls=[call('{"q": "a"}')]),
     ChatMessage(role="tool", tool_call_id="call_0", content="result a")],
    [ChatMessage(role="user", content="q"), ChatMessage(role="assistant", content="", tool_calls=[call('{"q": "b"}')]),
     ChatMessage(role="tool", tool_call_id="call_0", content="result b")],
    [ChatMessage(role="user", content="q"), ChatMessage(role="assistant", content="a", reasoning_content="because"),
     ChatMessage(role="user", content="again")],
    [ChatMessage(role="user", content="q"), ChatMessage(role="assistant", content="a"), ChatMessage(role="user", content="again")],
    [ChatMessage(role="user", content=[TextPart("one"), TextPart("two")])],
]


@pytest.mark.parametrize("family", TEMPLATE_FAMILIES)
def test_cached_renders_are_the_renders(family, tiny_models):
    cached, uncached = formats(family, tiny_models)
    cases = [(c, None, {}) for c in CONVERSATIONS]
    cases += [(CONVERSATIONS[0], [tool("search")], {}), (CONVERSATIONS[1], [tool("lookup")], {}),
              (CONVERSATIONS[0], None, {"enable_thinking": False, "thinking": False})]
    for _ in range(2):  # the second round renders from the cache
        for messages, tools, kwargs in cases:
            for gen in (True, False):
                got = cached.render(messages, tools, dict(kwargs), add_generation_prompt=gen)
                want = uncached.render(messages, tools, dict(kwargs), add_generation_prompt=gen)
                assert (got.text, got.token_ids) == (want.text, want.token_ids), (messages, tools, kwargs, gen)
    assert len(cached._renders._entries) > len(CONVERSATIONS)  # shapes kept apart, texts shared


def test_a_shape_is_templated_once(tiny_models, monkeypatch):
    cached, _ = formats("qwen3", tiny_models)
    calls = []
    apply = cached._apply
    monkeypatch.setattr(cached, "_apply", lambda *args: calls.append(1) or apply(*args))
    first = cached.render([ChatMessage(role="user", content="one")], None, {})
    second = cached.render([ChatMessage(role="user", content="two, longer")], None, {})
    assert len(calls) == 1 and first.token_ids != second.token_ids
    cached.render([ChatMessage(role="user", content="x")], None, {"enable_thinking": False})
    assert len(calls) == 2  # other template arguments: another shape


def test_templates_that_read_the_clock_or_chance_are_not_kept():
    assert RenderCache.deterministic("{{ messages[0].content }}")
    assert not RenderCache.deterministic("Today Date: {{ strftime_now('%d %b %Y') }}")
    assert not RenderCache.deterministic("{{ lipsum(1) }}")
    assert not RenderCache.deterministic({"default": "{{ x }}"})


def test_a_request_template_is_never_kept(tiny_models):
    cached, _ = formats("qwen3", tiny_models)
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    rendered = cached.render([ChatMessage(role="user", content="hi")], None, {"chat_template": template})
    assert rendered.text == "[user]hi" and not cached._renders._entries


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(RenderCache, "MAX_ENTRIES", 2)
    monkeypatch.setattr(RenderCache, "MAX_CHARS", 10)
    cache = RenderCache()
    for key in (b"a", b"b", b"c"):
        cache.put(key, ["x", "0", "y"])
    assert cache.get(b"a") is None and cache.get(b"c") == ["x", "0", "y"]
    cache.put(b"big", ["x" * 11])
    assert cache.get(b"big") is None
