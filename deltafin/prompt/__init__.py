"""Prompt formats (messages + tools -> token ids) and, per family, the output parsers."""

from deltafin.prompt.chat_format import ChatFormat, build_chat_format

__all__ = ["ChatFormat", "build_chat_format"]
