"""HTTP plumbing every upstream shares: reading an SSE body, and turning upstream failures into Deltafin errors."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, AsyncIterator, Mapping, Sequence

import httpx

from deltafin.engine.events import TokenLogprob
from deltafin.errors import (
    ContextLengthError,
    DeltafinError,
    InvalidRequestError,
    UpstreamBusyError,
    UpstreamError,
    UpstreamUnavailableError,
)

#: wording vLLM, SGLang and llama-server use when a prompt does not fit their context
_CONTEXT_WORDS = re.compile(r"context length|context size|context window|exceed_context|maximum context|longer than", re.I)


@dataclass
class Chunk:
    """One upstream stream event, engine-neutral. `logprobs` is aligned with `token_ids` or empty."""

    token_ids: Sequence[int] = ()
    logprobs: Sequence[TokenLogprob | None] = ()
    #: "stop" / "length" once the upstream ended the choice
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    #: an error the upstream reported inside its 200 stream
    error: str | None = None


class Garbled(UpstreamError):
    """The upstream's 200 body is not what its protocol promises."""


async def sse_payloads(response: httpx.Response) -> AsyncIterator[Any]:
    """The decoded JSON of each `data:` event; stops at `[DONE]`. A JSON (non-SSE) body is one payload."""
    if response.headers.get("content-type", "").startswith("application/json"):
        yield _json(await response.aread())
        return
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments (": ping"), `event:` names
        data = line[5:].strip()
        if data == "[DONE]":
            return
        if data:
            yield _json(data)


def _json(data: str | bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        raise Garbled(f"The upstream sent a stream event that is not JSON: {str(data)[:200]!r}") from None


def error_event(engine: str, payload: Any) -> Chunk | None:
    """What every upstream's events share: a JSON object, which may be `{"error": ...}` inside a 200 stream."""
    if not isinstance(payload, dict):
        raise Garbled(f"{engine} sent {type(payload).__name__}, not an object")
    if "error" not in payload:
        return None
    error = payload["error"]
    return Chunk(error=str(error.get("message", error)) if isinstance(error, dict) else str(error))


def error_message(body: bytes | str) -> str:
    """The human message inside an upstream error body (OpenAI, FastAPI and llama-server shapes)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        parsed = json.loads(text)
    except ValueError:
        return text.strip()[:500] or "(empty body)"
    if isinstance(parsed, dict):
        inner = parsed.get("error", parsed)
        if isinstance(inner, dict):
            for key in ("message", "detail", "msg"):
                if isinstance(inner.get(key), str):
                    return inner[key]
        if isinstance(inner, str):
            return inner
        if isinstance(parsed.get("detail"), str):
            return parsed["detail"]
    return text.strip()[:500]


def context_error(context_length: int, prompt_tokens: int) -> ContextLengthError:
    return ContextLengthError(
        f"This model's maximum context length is {context_length} tokens. However, your request has "
        f"{prompt_tokens} input tokens. Please reduce the length of the input.",
        context_length=context_length,
        prompt_tokens=prompt_tokens,
    )


@dataclass(frozen=True)
class Target:
    """Who we talk to, for messages: `vllm at http://gpu-node:8000`."""

    engine: str
    url: str
    retry_after_s: int = 2

    def __str__(self) -> str:
        return f"{self.engine} at {self.url}"


def error_for_status(target: Target, status: int, body: bytes, headers: Mapping[str, str], *,
                     context_length: int, prompt_tokens: int) -> DeltafinError:
    """What a non-200 upstream answer means to Deltafin's client."""
    message = error_message(body)
    retry = headers.get("retry-after") or str(target.retry_after_s)
    if status == 429:
        return UpstreamBusyError(f"The upstream {target} is busy: {message}", headers={"Retry-After": retry})
    if status == 503:
        return UpstreamUnavailableError(f"The upstream {target} is not ready: {message}", headers={"Retry-After": retry})
    if status in (400, 413, 422) and _CONTEXT_WORDS.search(message):
        return context_error(context_length, prompt_tokens)
    if status == 400:
        # Deltafin validated the request; what is left (a bad grammar, say) is the client's to fix.
        return InvalidRequestError(f"The upstream {target} rejected the request: {message}")
    return UpstreamError(f"The upstream {target} answered HTTP {status}: {message}")


def error_in_stream(target: Target, message: str, *, context_length: int, prompt_tokens: int) -> DeltafinError:
    """An error the upstream reported inside a 200 stream (SGLang does, so does llama-server)."""
    if _CONTEXT_WORDS.search(message):
        return context_error(context_length, prompt_tokens)
    return UpstreamError(f"The upstream {target} failed: {message}")


def token_logprob(token_id: int, logprob: float, top: Sequence[tuple[int, float]] = ()) -> TokenLogprob:
    return TokenLogprob(int(token_id), float(logprob), tuple((int(t), float(lp)) for t, lp in top))


def id_from_token_string(token: str) -> int | None:
    """vLLM's `return_tokens_as_token_ids` spelling: "token_id:123"."""
    if token.startswith("token_id:"):
        try:
            return int(token[9:])
        except ValueError:
            return None
    return None
