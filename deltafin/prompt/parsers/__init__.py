"""Output parsers: one module per markup (think, kimi_k2, kimi_k3, glm, hermes), combined per model family
in deltafin/families/ (a family picks its parsers; nothing here is keyed by model name)."""

from deltafin.prompt.parsers.base import IdFactory, OutputParser, ParsedDelta, PlainOutputParser, ToolCallDelta

__all__ = ["IdFactory", "OutputParser", "ParsedDelta", "PlainOutputParser", "ToolCallDelta"]
