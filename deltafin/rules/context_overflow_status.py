"""context_overflow_status (glm_context_413 in para): a prompt over the context gets another HTTP status.

Acts on: context-length errors (400 `context_length_exceeded`), which become `status` (413,
`PayloadTooLargeError`) with the same message, streaming requests included (the check runs before the first
byte). Leaves alone: every other error.
"""

from __future__ import annotations

from typing import Literal

from deltafin.errors import ContextLengthError, DeltafinError, PayloadTooLargeError
from deltafin.rules.base import Rule, RuleContext


class ContextOverflowStatus(Rule):
    def __init__(self, status: Literal[413] = 413) -> None:
        if status != 413:
            raise ValueError("only 413 (PayloadTooLargeError) is supported")
        self.status = status

    def error(self, error: DeltafinError, ctx: RuleContext) -> DeltafinError:
        if not isinstance(error, ContextLengthError):
            return error
        return PayloadTooLargeError(
            error.message, param=error.param, code="context_length_exceeded", headers=error.headers
        )
