"""OpenAI logprobs shapes, chat and legacy completions, from engine TokenLogprobs."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from deltafin.engine import PromptLogprobs, TokenLogprob

TokenText = Callable[[int], str]


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(items: Iterable[TokenLogprob], token_text: TokenText) -> list[dict[str, Any]]:
    out = []
    for item in items:
        entry = _entry(token_text(item.token_id), item.logprob)
        entry["top_logprobs"] = [_entry(token_text(t), lp) for t, lp in item.top]
        out.append(entry)
    return out


def completion_logprobs(
    items: Iterable[TokenLogprob], token_text: TokenText, offset: int, prompt: PromptLogprobs | None = None
) -> dict[str, Any]:
    """Legacy completions logprobs; with `prompt` (echo), the prompt's tokens come first, the first with null."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    pairs: list[tuple[int, TokenLogprob | None]] = []
    if prompt is not None:
        pairs += list(zip(prompt.token_ids, prompt.logprobs))
        offset = 0
    pairs += [(item.token_id, item) for item in items]
    for token_id, item in pairs:
        text = token_text(token_id)
        tokens.append(text)
        token_logprobs.append(None if item is None else item.logprob)
        tops.append({token_text(t): lp for t, lp in item.top} if item is not None and item.top else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
