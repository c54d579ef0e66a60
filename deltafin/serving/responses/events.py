"""A streamed chat answer (chat chunk dicts, after the rules) as OpenAI's Responses event stream.

Sequence: response.created, response.in_progress; per output item output_item.added, then for text
content_part.added, output_text.delta ... output_text.done, content_part.done (reasoning the same with
reasoning_text events; a function call function_call_arguments.delta ... done), output_item.done; last
response.completed (or response.incomplete when the token budget cut it) carrying the whole response. An error
once streaming began ends the stream with response.failed. Every event has its `sequence_number`, from 0.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from deltafin.errors import DeltafinError, EngineBusyError
from deltafin.serving.responses.items import Item
from deltafin.serving.responses.output import ResponseShape, chat_usage_to_response, output_logprobs

_encode = msgspec.json.Encoder().encode


def sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + _encode(event) + b"\n\n"


class _Open:
    """The output item being streamed: its index, item dict and what it collected."""

    def __init__(self, kind: str, index: int, item: Item) -> None:
        self.kind = kind
        self.index = index
        self.item = item
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []


class ResponseEvents:
    def __init__(self, shape: ResponseShape, reasoning_tokens: Callable[[], int]) -> None:
        self.shape = shape
        self._reasoning_tokens = reasoning_tokens
        self._sequence = 0
        self.output: list[Item] = []
        self._open: _Open | None = None
        self._calls: dict[int, _Open] = {}  # chat tool-call index -> its item
        self._logprobs = shape.request.includes("message.output_text.logprobs")
        self.final: dict[str, Any] | None = None  # the last response body sent (completed / incomplete / failed)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    async def events(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        started = self.shape.body("in_progress", [])
        yield self._event("response.created", response=started)
        yield self._event("response.in_progress", response=started)
        finish: str | None = None
        chat_usage: dict[str, Any] | None = None
        async for chunk in chunks:
            if chunk.get("usage"):
                chat_usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    for event in self._reasoning_delta(delta["reasoning_content"]):
                        yield event
                if delta.get("content"):
                    logprobs = (choice.get("logprobs") or {}).get("content") or []
                    for event in self._text_delta(delta["content"], logprobs):
                        yield event
                for call in delta.get("tool_calls") or ():
                    for event in self._call_delta(call):
                        yield event
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
        incomplete = finish == "length"
        status = "incomplete" if incomplete else "completed"
        if not self.output and self._open is None:  # an empty answer is still an (empty) message
            for event in self._text_delta("", []):
                yield event
        for event in self._close(status):
            yield event
        self.final = self.shape.body(
            status,
            self.output,
            usage=chat_usage_to_response(chat_usage, self._reasoning_tokens()),
            incomplete_reason="max_output_tokens" if incomplete else None,
        )
        yield self._event("response.incomplete" if incomplete else "response.completed", response=self.final)

    def failed(self, error: DeltafinError) -> list[dict[str, Any]]:
        """The closing events of a stream that failed after it began: the open item ends incomplete."""
        code = "rate_limit_exceeded" if isinstance(error, EngineBusyError) else "server_error"
        events = self._close("incomplete")
        self.final = self.shape.body("failed", self.output, error={"code": code, "message": error.message})
        return [*events, self._event("response.failed", response=self.final)]

    def _close(self, status: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        opened = self._open
        if opened is None:
            return events
        self._open = None
        item, index = opened.item, opened.index
        if opened.kind == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                    name=item["name"],
                )
            )
            done = {**item, "status": status}
        else:
            text = "".join(opened.text)
            if opened.kind == "reasoning":
                part = {"type": "reasoning_text", "text": text}
                events.append(
                    self._event(
                        "response.reasoning_text.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        text=text,
                    )
                )
                done = self.shape.reasoning_item(text, status=status)
            else:
                logprobs = output_logprobs(opened.logprobs) if self._logprobs else None
                done = self.shape.message_item(text, status=status, logprobs=logprobs)
                part = done["content"][0]
                events.append(
                    self._event(
                        "response.output_text.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        text=text,
                        logprobs=_delta_logprobs(opened.logprobs),
                    )
                )
            done["id"] = item["id"]
            events.append(
                self._event(
                    "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                )
            )
        self.output.append(done)
        events.append(self._event("response.output_item.done", output_index=index, item=done))
        return events

    def _start(self, kind: str, item: Item) -> list[dict[str, Any]]:
        events = self._close("completed")
        self._open = _Open(kind, len(self.output), item)
        events.append(self._event("response.output_item.added", output_index=self._open.index, item=item))
        if kind != "function_call":
            part = (
                {"type": "reasoning_text", "text": ""}
                if kind == "reasoning"
                else {"type": "output_text", "text": "", "annotations": []}
            )
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self._open.index,
                    content_index=0,
                    part=part,
                )
            )
        return events

    def _reasoning_delta(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open.kind != "reasoning":
            item = self.shape.reasoning_item("", status="in_progress")
            item.pop("encrypted_content", None)
            item["content"] = []
            events += self._start("reasoning", item)
        opened = self._open
        assert opened is not None
        opened.text.append(text)
        events.append(
            self._event(
                "response.reasoning_text.delta",
                item_id=opened.item["id"],
                output_index=opened.index,
                content_index=0,
                delta=text,
            )
        )
        return events

    def _text_delta(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open.kind != "message":
            item = self.shape.message_item("", status="in_progress")
            item["content"] = []
            events += self._start("message", item)
        opened = self._open
        assert opened is not None
        opened.text.append(text)
        opened.logprobs += logprobs
        if text:
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=opened.item["id"],
                    output_index=opened.index,
                    content_index=0,
                    delta=text,
                    logprobs=_delta_logprobs(logprobs),
                )
            )
        return events

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        function = call.get("function") or {}
        if call.get("id") is not None:
            item = self.shape.call_item(call["id"], function.get("name") or "", "", status="in_progress")
            events += self._start("function_call", item)
            assert self._open is not None
            self._calls[call["index"]] = self._open
        opened = self._calls.get(call["index"])
        fragment = function.get("arguments") or ""
        if opened is None or not fragment:
            return events
        if opened is not self._open:  # a call whose item is closed already: arguments stay with it
            opened.item["arguments"] += fragment
            return events
        opened.item["arguments"] += fragment
        events.append(
            self._event(
                "response.function_call_arguments.delta",
                item_id=opened.item["id"],
                output_index=opened.index,
                delta=fragment,
            )
        )
        return events


def _delta_logprobs(chat_logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "token": lp["token"],
            "logprob": lp["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in lp.get("top_logprobs") or ()],
        }
        for lp in chat_logprobs
    ]
