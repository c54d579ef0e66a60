"""A traced request's engine work, as marks the app turns into spans (deltafin.app.tracing): the engine knows
neither OpenTelemetry nor HTTP, it writes down when things happened.

The app sets `current_timeline` for a traced request (`server.tracing`); `EngineFront.start` hands it to the
request's stream (`GenerationStream.timeline`), where the engines find it: the front marks the queue wait, the
local engine each prompt's prefill (its chunks as children) and each choice's decode, an upstream engine each
call it makes, with the span id whose `traceparent` it sent, so the upstream's own spans hang under it. A request
that is not traced has no timeline: the engines test `stream.timeline is not None` once per prompt, chunk or
choice (never per token), which is all tracing costs when it is off.
"""

from __future__ import annotations

import os
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

#: the traced request's timeline, set by the app around the request's work
current_timeline: ContextVar[Timeline | None] = ContextVar("deltafin_timeline", default=None)


def now_ns() -> int:
    """The clock marks are in: Unix time in nanoseconds (what span start and end times are)."""
    return time.time_ns()


@dataclass
class Mark:
    """One span to be: what, when (`now_ns` instants), its attributes, the spans under it; `span_id` when the
    span's id is already out (an upstream call's traceparent), else None (the exporter gives it one)."""

    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    children: list[Mark] = field(default_factory=list)
    span_id: int | None = None
    kind: str = "internal"  # or "client": a call to another server


@dataclass
class Call:
    """A call to another server: its span's id, the headers that carry it there, what is known of it so far."""

    span_id: int
    headers: dict[str, str]
    attributes: dict[str, Any] = field(default_factory=dict)


class Timeline:
    """The marks of one request, under its span (`trace_id`, `span_id`); `sampled`: whether the trace is recorded.
    An unsampled request still has one: its upstream calls carry its traceparent (flags 00), as W3C asks."""

    def __init__(self, trace_id: int, span_id: int, *, sampled: bool, trace_state: str = "") -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.sampled = sampled
        self.trace_state = trace_state
        self.marks: list[Mark] = []
        #: the first job's sampling parameters and the number of choices (set by the front, for the request span)
        self.params: Any = None
        self.choices = 0
        self._calls: dict[Any, Call] = {}

    def add(self, mark: Mark) -> None:
        """Keep `mark` (from any thread: list.append is atomic); an unsampled request keeps nothing."""
        if self.sampled:
            self.marks.append(mark)

    def call(self, key: Any) -> Call:
        """The call `key` names (an upstream request's choice; a resend of it is the same call): a span id of its
        own, and the headers that continue the trace there under it (W3C trace context: `traceparent`, and
        `tracestate` when the trace has one)."""
        found = self._calls.get(key)
        if found is None:
            span_id = int.from_bytes(os.urandom(8), "big") or 1
            headers = {"traceparent": f"00-{self.trace_id:032x}-{span_id:016x}-{'01' if self.sampled else '00'}"}
            if self.trace_state:
                headers["tracestate"] = self.trace_state
            found = self._calls[key] = Call(span_id, headers)
        return found
