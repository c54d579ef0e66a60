"""What every upstream protocol shares above HTTP: SSE framing, JSON events, and upstream failures as Deltafin errors."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from deltafin.engine.events import TokenLogprob
from deltafin.engine.upstream.http1 import Response
from deltafin.errors import (
    ContextLengthError,
    DeltafinError,
    InvalidRequestError,
    UpstreamBusyError,
    UpstreamError,
    UpstreamUnavailableError,
)

#: wording vLLM, SGLang and llama-server use when a prompt does not fit their context
_CONTEXT_WORDS = re.compile(
    r"context length|context size|context window|exceed_context|maximum context|longer than", re.I
)


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


#: msgspec's decoder: several times faster than `json.loads` on the small objects every token brings
_decode = msgspec.json.Decoder().decode


class SseSplitter:
    """Server-sent-event framing, incrementally: `feed` body bytes, get the `data` of each event completed by
    them. Lines end in LF, CRLF or CR; `data:` takes one optional space; several data lines join with LF;
    comments (`: ping`) and other fields are skipped; an event cut off by the end of the body is never
    returned (the caller decides what a missing finish means)."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._pending + data if self._pending else data
        if b"\r" in buf:
            held = b"\r" if buf.endswith(b"\r") else b""  # maybe the first half of a CRLF split between reads
            buf = buf[: len(buf) - len(held)].replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        else:
            held = b""
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._pending = buf + held
            return []
        self._pending = buf[end + 2 :] + held
        out = []
        for event in buf[:end].split(b"\n\n"):
            if event.startswith(b"data:") and b"\n" not in event:  # the common case: one data line
                out.append(event[6:] if event[5:6] == b" " else event[5:])
                continue
            lines = [
                line[6:] if line[5:6] == b" " else line[5:] for line in event.split(b"\n") if line.startswith(b"data:")
            ]
            if lines:
                out.append(b"\n".join(lines))
        return out


async def sse_batches(response: Response) -> AsyncIterator[list[Any]]:
    """The decoded JSON of the `data:` events, one list per network read (so events that arrived together are
    handled together); stops at `[DONE]`. A JSON (non-SSE) body is one batch of one payload."""
    if response.headers.get("content-type", "").startswith("application/json"):
        yield [_json(await response.read_all())]
        return
    splitter = SseSplitter()
    while data := await response.read_some():
        batch: list[Any] = []
        for event in splitter.feed(data):
            if event == b"[DONE]" or event.strip() == b"[DONE]":
                if batch:
                    yield batch
                return
            if event.strip():
                try:
                    batch.append(_json(event))
                except Garbled:
                    if batch:  # what came before the garbage was fine: it counts, then the error
                        yield batch
                    raise
        if batch:
            yield batch


def _json(data: bytes) -> Any:
    try:
        return _decode(data)
    except msgspec.DecodeError:
        pass
    try:  # Python's own writer spells -inf logprobs `-Infinity`, which only json.loads reads
        return json.loads(data)
    except ValueError:
        raise Garbled(f"The upstream sent a stream event that is not JSON: {data[:200]!r}") from None


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


def error_for_status(
    target: Target, status: int, body: bytes, headers: Mapping[str, str], *, context_length: int, prompt_tokens: int
) -> DeltafinError:
    """What a non-200 upstream answer means to Deltafin's client."""
    message = error_message(body)
    retry = headers.get("retry-after") or str(target.retry_after_s)
    if status == 429:
        return UpstreamBusyError(f"The upstream {target} is busy: {message}", headers={"Retry-After": retry})
    if status == 503:
        return UpstreamUnavailableError(
            f"The upstream {target} is not ready: {message}", headers={"Retry-After": retry}
        )
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
