"""/parse: raw output of any size is parsed in time linear in its length, off the event loop, and as a stream
of it would be parsed.

The cost is measured by what the parsers scan (the characters handed to their marker search), which is exact
and the same on any machine: whole, a text was scanned again from each of its markers, so 4x the calls cost
16x; a piece at a time, 4x."""

from __future__ import annotations

import threading

import msgspec
import pytest
from litestar.testing import TestClient

from deltafin.app import build_app
from deltafin.markup import MARKUPS, parsing
from deltafin.protocol.chat import ToolDefinition
from deltafin.serving.parse import PIECE_CHARS, ParseService, feed_in_pieces

TOOLS = [
    msgspec.convert(
        {
            "type": "function",
            "function": {
                "name": "get",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}}},
            },
        },
        ToolDefinition,
    )
]


def parser(name: str):
    return MARKUPS[name].output_parser(prompt_text="", tools=TOOLS, calls_allowed=True, new_id=lambda i, n: f"id{i}")


def scanned(monkeypatch, name: str, text: str) -> int:
    """Characters the markup's parsers hand to the marker search while /parse reads `text`."""
    total = 0
    search = parsing.split_at_marker

    def counting(buffer, markers):
        nonlocal total
        total += len(buffer)
        return search(buffer, markers)

    for module in ("deltafin.markup.glm", "deltafin.markup.think", "deltafin.markup.kimi_k2", "deltafin.markup.xtml"):
        monkeypatch.setattr(f"{module}.split_at_marker", counting)
    feed_in_pieces(parser(name), text, "stop")
    return total


def calls(name: str, count: int) -> str:
    return MARKUPS[name].write([("get", {"city": "Paris", "n": i}) for i in range(count)])


@pytest.mark.parametrize("name", ["glm47", "glm45", "kimi_k2", "xtml"])
def test_the_cost_grows_with_the_text_not_its_square(monkeypatch, name):
    small, large = calls(name, 2000), calls(name, 8000)
    growth = scanned(monkeypatch, name, large) / scanned(monkeypatch, name, small)
    assert growth < 5, growth  # linear: ~4; a whole text scanned again at each marker: ~16


@pytest.mark.parametrize("name", sorted(set(MARKUPS) - {"forced_json"}))
@pytest.mark.parametrize(
    "text",
    [
        "CALLS",
        "CALLS with a value longer than a piece",
        " \n" * PIECE_CHARS,  # whitespace held while the answer may still open reasoning
        "plain text " * 300,
    ],
)
def test_in_pieces_is_the_whole_text_parsed_at_once(name, text):
    if text.startswith("CALLS"):
        long = "x" * (3 * PIECE_CHARS + 7) if "longer" in text else "Paris"
        text = MARKUPS[name].write([("get", {"city": long, "n": 12345}), ("get", {"city": "Rome", "n": 2})])
    whole = parser(name)
    expected = whole.feed(text).extend(whole.finish("stop"))
    got = feed_in_pieces(parser(name), text, "stop")
    assert (got.content, got.reasoning) == (expected.content, expected.reasoning)

    def joined(deltas):
        out: dict[int, list] = {}
        for delta in deltas:
            head = out.setdefault(delta.index, [delta.id, delta.name, ""])
            head[2] += delta.arguments
        return out

    assert joined(got.tool_calls) == joined(expected.tool_calls)


def test_a_large_text_is_parsed_in_the_large_prompt_lane(config, services, monkeypatch):
    """Off the event loop, and not in the lane of ordinary prompts: a 4 MB /parse waits beside other large
    bodies (bounded by server.queue.max_large_prompts), never in front of a one-line chat's render."""
    threads = []
    parse = ParseService.parse

    def recording(self, request):
        threads.append(threading.current_thread().name)
        return parse(self, request)

    monkeypatch.setattr(ParseService, "parse", recording)
    with TestClient(build_app(config, services)) as client:
        small = client.post("/parse", json={"text": "hi"})
        large = client.post("/parse", json={"text": "word " * (config.server.queue.large_body_bytes // 4)})
    assert small.status_code == 200 and large.status_code == 200, large.text
    assert threads[0].startswith("deltafin-prompt") and not threads[0].startswith("deltafin-prompt-large")
    assert threads[1].startswith("deltafin-prompt-large"), threads
