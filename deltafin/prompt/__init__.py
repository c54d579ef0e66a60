"""Prompt formats: messages + tools -> token ids (what the model writes back is read by deltafin.markup)."""

from deltafin.prompt.chat_format import NO_OPTIONS, ChatFormat, PromptOptions, RenderedPrompt, build_chat_format

__all__ = ["NO_OPTIONS", "ChatFormat", "PromptOptions", "RenderedPrompt", "build_chat_format"]
