"""Chat formats by name (`model.chat_format`): `template`, the checkpoint's own Jinja template
(deltafin.prompt.template), and `xtml`, Kimi K3's prompt built in code as K3's encoder builds it
(deltafin.prompt.xtml). Both render OpenAI messages and tools to token ids whose control tokens come only
from the format, never from anything a client wrote."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deltafin.prompt.format import NO_OPTIONS, ChatFormat, PromptOptions, RenderedPrompt, message_text
from deltafin.prompt.template import TemplateChatFormat
from deltafin.prompt.xtml import XtmlChatFormat

__all__ = [
    "CHAT_FORMATS",
    "NO_OPTIONS",
    "ChatFormat",
    "PromptOptions",
    "RenderedPrompt",
    "build_chat_format",
    "message_text",
]

CHAT_FORMATS: dict[str, Callable[..., ChatFormat]] = {"template": TemplateChatFormat, "xtml": XtmlChatFormat}


def build_chat_format(name: str, tokenizer: Any, *, content_format: str, default_kwargs: dict[str, Any]) -> ChatFormat:
    """The registered chat format called `name` (model.chat_format)."""
    try:
        factory = CHAT_FORMATS[name]
    except KeyError:
        raise ValueError(f"model.chat_format: unknown format {name!r} (known: {', '.join(CHAT_FORMATS)})") from None
    return factory(tokenizer, content_format=content_format, default_kwargs=default_kwargs)
