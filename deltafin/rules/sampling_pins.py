"""sampling_pins (kimi_sampling_pins in para): fixed sampling values, whatever the client asked for.

Acts on: chat and completion requests where any pinned field differs from its pin (an omitted field
counts as different). Leaves alone: requests that already carry every pinned value. Pinnable: top_p,
top_k, min_p, temperature, presence_penalty, frequency_penalty, repetition_penalty, n.
"""

from __future__ import annotations

import typing
from typing import Any, ClassVar

import msgspec

from deltafin.protocol.common import SamplingFields
from deltafin.rules.base import Request, Rule, RuleContext

PINNABLE = (
    "top_p",
    "top_k",
    "min_p",
    "temperature",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "n",
)


class SamplingPins(Rule):
    #: each pin is typed and ranged as the request field it replaces (checked at start-up: deltafin.rules.arguments)
    argument_types: ClassVar[dict[str, Any]] = {
        name: hint
        for name, hint in typing.get_type_hints(SamplingFields, include_extras=True).items()
        if name in PINNABLE
    }

    def __init__(self, **pins: Any) -> None:
        unknown = sorted(set(pins) - set(PINNABLE))
        if unknown:
            raise ValueError(f"cannot pin {unknown[0]!r} (pinnable: {', '.join(PINNABLE)})")
        if not pins:
            raise ValueError("give at least one field to pin, e.g. top_p: 0.95")
        self.pins = pins

    def request(self, request: Request, ctx: RuleContext) -> Request:
        changes = {k: v for k, v in self.pins.items() if getattr(request, k) != v}
        if not changes:
            return request
        return msgspec.structs.replace(request, **changes)
