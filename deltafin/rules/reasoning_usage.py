"""reasoning_usage (glm_reasoning_usage in para): usage reports `completion_tokens_details.reasoning_tokens`.

Acts on: chat responses with usage, non-streamed, and the final usage chunk of streams that asked for
usage. The count is the serving layer's (reasoning text re-tokenized; always part of completion_tokens).
Leaves alone: streams without `stream_options.include_usage`, completions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from deltafin.rules.base import Chunk, Rule, RuleContext


def _with_details(body: dict, ctx: RuleContext) -> dict:
    usage = body.get("usage")
    if not usage:
        return body
    details = {**(usage.get("completion_tokens_details") or {}), "reasoning_tokens": ctx.reasoning_tokens}
    return {**body, "usage": {**usage, "completion_tokens_details": details}}


class ReasoningUsage(Rule):
    def response(self, body: dict, ctx: RuleContext) -> dict:
        if ctx.endpoint != "chat":
            return body
        return _with_details(body, ctx)

    def stream(self, chunks: AsyncIterator[Chunk], ctx: RuleContext) -> AsyncIterator[Chunk] | None:
        if ctx.endpoint != "chat" or not ctx.include_usage:
            return None
        return self._rewrite(chunks, ctx)

    async def _rewrite(self, chunks: AsyncIterator[Chunk], ctx: RuleContext) -> AsyncIterator[Chunk]:
        async for chunk in chunks:
            yield _with_details(chunk, ctx) if chunk.get("usage") else chunk
