"""streaming_error_preflight: hold a stream's HTTP status until its first chunk has been produced.

Errors known before generation (validation, template, context) are real HTTP statuses without this rule.
With it, an error raised while producing the first chunk (the engine failing at prefill, say) also becomes
a plain HTTP error instead of a 200 followed by an in-stream error event, which the OpenAI SDK cannot retry.
Acts on: streaming requests whose first chunk fails. Leaves alone: everything else.
"""

from __future__ import annotations

from deltafin.rules.base import Rule


class StreamingErrorPreflight(Rule):
    preflight = True
