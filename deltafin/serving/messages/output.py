"""A chat answer as an Anthropic Message: a whole chat body as the Message object, chat chunks as the Messages
event stream.

Blocks come in the order the model wrote them: thinking (the reasoning), text, then one tool_use per call. A
thinking block's `signature` carries its reasoning (deltafin.serving.encoded_reasoning), so a client that keeps
only the signature (`thinking.display: "omitted"`, which Claude Code asks for: the text is then "") still sends
the reasoning back. A call's `input` is its arguments parsed as a JSON object; arguments that are not one (a
model cut off mid-call) give `{}`, never a string.

Events: message_start, ping, then per block content_block_start, its deltas (thinking_delta, text_delta; a
tool_use block's input as one input_json_delta of the whole JSON at its end, so every prefix the SDK re-parses is
valid; a thinking block's signature_delta just before its stop), content_block_stop; then message_delta
(stop_reason, stop_sequence, the usage so far) and message_stop. Pings also go out while the first chunk is
awaited (a long prompt's prefill). An error once the stream began is an `error` event.

stop_reason: end_turn, max_tokens (the budget cut it), stop_sequence (with the matched `stop_sequence`),
tool_use. Usage: `input_tokens` the prompt's tokens not read from the prefix cache, `cache_read_input_tokens`
those that were (Anthropic's meaning: the prompt is their sum), `cache_creation_input_tokens` 0, `output_tokens`
every generated token, reasoning included.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import structlog

from deltafin.errors import DeltafinError, anthropic_error
from deltafin.serving.encoded_reasoning import encode_reasoning

log = structlog.get_logger("deltafin.messages")

_encode = msgspec.json.Encoder().encode

#: seconds between pings while the first chunk is awaited
PING_INTERVAL_S = 5.0
PING = {"type": "ping"}


def new_message_id() -> str:
    return f"msg_{os.urandom(12).hex()}"


def sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + _encode(event) + b"\n\n"


def error_event(error: DeltafinError) -> dict[str, Any]:
    return anthropic_error(error)[1]


def tool_input(arguments: str, name: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        value = None
    if isinstance(value, dict):
        return value
    log.warning("messages_tool_input_not_an_object", tool=name, arguments=arguments[:200])
    return {}


def thinking_block(text: str, *, omitted: bool) -> dict[str, Any]:
    return {"type": "thinking", "thinking": "" if omitted else text, "signature": encode_reasoning(text)}


def stop_reason(finish_reason: str | None, matched: Any, stop_sequences: Sequence[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat choice's finish_reason and the stop it matched (vLLM's
    `stop_reason`: the stop string, or a stop token's id)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def usage(chat_usage: dict[str, Any] | None, prompt_tokens: int) -> dict[str, Any]:
    chat_usage = chat_usage or {}
    prompt = chat_usage.get("prompt_tokens", prompt_tokens)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": prompt - cached,
        "output_tokens": chat_usage.get("completion_tokens", 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


class MessageShape:
    """What every form of one answer shares: its id, the model name it echoes, how thinking is shown."""

    def __init__(self, model: str, *, omit_thinking: bool, stop_sequences: Sequence[str] | None) -> None:
        self.id = new_message_id()
        self.model = model
        self.omit_thinking = omit_thinking
        self.stop_sequences = tuple(stop_sequences or ())

    def body(self, content: list[dict[str, Any]], reason: str | None, sequence: str | None, use: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": use,
        }

    def from_chat(self, completion: dict[str, Any]) -> dict[str, Any]:
        """The Message a non-streamed chat completion body stands for."""
        choice = completion["choices"][0]
        message = choice["message"]
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append(thinking_block(message["reasoning_content"], omitted=self.omit_thinking))
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            function = call["function"]
            content.append(
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": function["name"],
                    "input": tool_input(function["arguments"], function["name"]),
                }
            )
        reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), self.stop_sequences)
        return self.body(content, reason, sequence, usage(completion.get("usage"), 0))


class _Block:
    def __init__(self, kind: str, index: int, call_index: int | None = None) -> None:
        self.kind = kind
        self.index = index
        self.call_index = call_index
        self.name = ""
        self.parts: list[str] = []


class MessageEvents:
    """Chat chunks (after the rules) in, Anthropic events out."""

    def __init__(self, shape: MessageShape, prompt_tokens: int) -> None:
        self.shape = shape
        self.prompt_tokens = prompt_tokens
        self._open: _Block | None = None
        self._blocks = 0

    async def events(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        started = {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        yield {"type": "message_start", "message": self.shape.body([], None, None, started)}
        yield PING
        finish: str | None = None
        matched: Any = None
        chat_usage: dict[str, Any] | None = None
        async for chunk in pinged(chunks):
            if chunk is PING:
                yield PING
                continue
            if chunk.get("usage"):
                chat_usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                for event in self._delta(delta):
                    yield event
                if choice.get("finish_reason"):
                    finish, matched = choice["finish_reason"], choice.get("stop_reason")
        for event in self._close():
            yield event
        reason, sequence = stop_reason(finish, matched, self.shape.stop_sequences)
        yield {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(chat_usage, self.prompt_tokens),
        }
        yield {"type": "message_stop"}

    def _delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            text = delta["reasoning_content"]
            if self._open is None or self._open.kind != "thinking":
                events += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            assert self._open is not None
            self._open.parts.append(text)
            if not self.shape.omit_thinking:
                events.append(self._block_delta({"type": "thinking_delta", "thinking": text}))
        if delta.get("content"):
            text = delta["content"]
            if self._open is None or self._open.kind != "text":
                events += self._start("text", {"type": "text", "text": ""})
            events.append(self._block_delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if call.get("id") is not None:
                block = {"type": "tool_use", "id": call["id"], "name": function.get("name", ""), "input": {}}
                events += self._start("tool_use", block, call_index=call["index"])
                assert self._open is not None
                self._open.name = function.get("name", "")
            if self._open is not None and self._open.call_index == call["index"]:
                self._open.parts.append(function.get("arguments") or "")
        return events

    def _block_delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        assert self._open is not None
        return {"type": "content_block_delta", "index": self._open.index, "delta": delta}

    def _start(self, kind: str, block: dict[str, Any], call_index: int | None = None) -> list[dict[str, Any]]:
        events = self._close()
        self._open = _Block(kind, self._blocks, call_index)
        self._blocks += 1
        events.append({"type": "content_block_start", "index": self._open.index, "content_block": block})
        return events

    def _close(self) -> list[dict[str, Any]]:
        opened = self._open
        if opened is None:
            return []
        events: list[dict[str, Any]] = []
        if opened.kind == "thinking":
            signature = thinking_block("".join(opened.parts), omitted=True)["signature"]
            events.append(self._block_delta({"type": "signature_delta", "signature": signature}))
        elif opened.kind == "tool_use":
            arguments = json.dumps(tool_input("".join(opened.parts), opened.name), ensure_ascii=False)
            events.append(self._block_delta({"type": "input_json_delta", "partial_json": arguments}))
        events.append({"type": "content_block_stop", "index": opened.index})
        self._open = None
        return events


async def pinged(
    chunks: AsyncIterator[dict[str, Any]], interval: float = PING_INTERVAL_S
) -> AsyncIterator[dict[str, Any]]:
    """`chunks`, with PING in between while the first one is awaited (a long prompt's prefill: proxies and
    clients that time out an idle stream see it alive). After the first chunk tokens flow; they pass as they are."""
    iterator = chunks.__aiter__()
    first = asyncio.ensure_future(iterator.__anext__())
    try:
        while not first.done():
            await asyncio.wait({first}, timeout=interval)
            if not first.done():
                yield PING
    finally:
        if not first.done():
            first.cancel()  # the consumer left while waiting: the generation stops with it
    try:
        chunk = first.result()
    except StopAsyncIteration:
        return
    yield chunk
    async for chunk in iterator:
        yield chunk
