"""OpenAI logprobs shapes, chat and legacy completions, from engine TokenLogprobs."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from deltafin.engine import TokenLogprob

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


def completion_logprobs(items: Iterable[TokenLogprob], token_text: TokenText, offset: int) -> dict[str, Any]:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for item in items:
        text = token_text(item.token_id)
        tokens.append(text)
        token_logprobs.append(item.logprob)
        tops.append({token_text(t): lp for t, lp in item.top} if item.top else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
