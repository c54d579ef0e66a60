"""Prompt formats (messages + tools -> token ids) and, per family, the output parsers."""

from deltafin.prompt.chat_format import NO_OPTIONS, ChatFormat, PromptOptions, RenderedPrompt, build_chat_format

__all__ = ["NO_OPTIONS", "ChatFormat", "PromptOptions", "RenderedPrompt", "build_chat_format"]
