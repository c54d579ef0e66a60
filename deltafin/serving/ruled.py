"""Runs one endpoint call inside the rule pipeline: request rules, then the work, then response/stream rules;
any DeltafinError on the way out is passed through the error rules."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from deltafin.errors import DeltafinError
from deltafin.rules import RuleContext
from deltafin.rules.base import Request
from deltafin.serving.context import RequestStats, ServingContext
from deltafin.serving.sampling_defaults import with_sampling_defaults
from deltafin.serving.sse import ChunkStream, StreamingResponse, encode_sse

Produce = Callable[[Any], Awaitable["dict[str, Any] | ChunkStream"]]
#: (chunks after the rules, the error rules, close) -> the SSE body; /v1/responses frames chat chunks its own way
Frame = Callable[
    [AsyncIterator[dict], Callable[[DeltafinError], DeltafinError], Callable[[], None]], AsyncIterator[bytes]
]


async def serve_with_rules(
    ctx: ServingContext,
    request: Request,
    rule_ctx: RuleContext,
    stats: RequestStats,
    produce: Produce,
    frame: Frame = encode_sse,
) -> dict[str, Any] | StreamingResponse:
    rules = ctx.rules
    try:
        # the model's defaults fill what the request leaves out; rules that pin or bound a field come after
        request = with_sampling_defaults(request, ctx.sampling_defaults)
        request = rules.on_request(request, rule_ctx, stats.rules)
        result = await produce(request)
        if isinstance(result, dict):
            return rules.on_response(result, rule_ctx, stats.rules)
        chunks = rules.on_stream(result.chunks, rule_ctx, stats.rules)
        if rules.preflight:
            chunks = await _pull_first(chunks, result.close, stats.rules, rules.preflight)
        body = frame(chunks, lambda err: rules.on_error(err, rule_ctx, stats.rules), result.close)
        return StreamingResponse(body, result.close, ready=result.ready or bool(rules.preflight))
    except DeltafinError as err:
        raise rules.on_error(err, rule_ctx, stats.rules) from None


async def _pull_first(
    chunks: AsyncIterator[dict], close: Callable[[], None], changed: list[str], preflight_rules: list[str]
) -> AsyncIterator[dict]:
    """Produce the first chunk before the status goes out, so a failure there is still a real HTTP error."""
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        return _empty()
    except DeltafinError:
        close()
        for name in preflight_rules:
            if name not in changed:
                changed.append(name)
        raise
    return _prepend(first, chunks)


async def _empty() -> AsyncIterator[dict]:
    return
    yield


async def _prepend(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    yield first
    async for chunk in rest:
        yield chunk
