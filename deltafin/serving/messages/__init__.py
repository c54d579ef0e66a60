"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) served through the chat path: see
service.py."""

from deltafin.serving.messages.service import MessagesService

__all__ = ["MessagesService"]
