"""Typed /parse requests: raw model output to run through the served model's parsers."""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

from deltafin.protocol.chat import ToolDefinition


class ParseRequest(Struct, kw_only=True):
    text: str
    tools: list[ToolDefinition] | None = None
    # None: the model's default; true/false: as if the prompt had thinking on/off.
    thinking: bool | None = None
    finish_reason: Literal["stop", "length"] = "stop"
    model: str | None = None
