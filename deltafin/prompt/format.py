"""What every chat format shares: the rendered prompt, the request options that shape it, and how OpenAI
messages and tools look to a renderer. The formats themselves are `template` (a checkpoint's Jinja) and `xtml`
(Kimi K3's code-built prompt); `chat_format` chooses between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from deltafin.errors import InvalidRequestError
from deltafin.protocol.chat import ChatMessage, ImagePart, ResponseFormat, TextPart, ToolDefinition


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class PromptOptions:
    """Request fields besides messages and tools that a format may render (K3 writes each as a system
    message; templates get `reasoning_effort` as a variable, as vLLM passes it)."""

    tool_choice: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None


NO_OPTIONS = PromptOptions()


class ChatFormat(Protocol):
    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolDefinition] | None,
        template_kwargs: dict[str, Any],
        *,
        add_generation_prompt: bool = True,
        options: PromptOptions = NO_OPTIONS,
    ) -> RenderedPrompt: ...


def refuse_images(index: int, message: ChatMessage) -> None:
    """Images get a clear 400 on these text-only models."""
    if isinstance(message.content, list):
        for j, part in enumerate(message.content):
            if isinstance(part, ImagePart):
                raise InvalidRequestError(
                    "this model accepts text only; image_url content is not supported",
                    param=f"messages[{index}].content[{j}]",
                )


def text_parts(index: int, message: ChatMessage) -> list[str]:
    """A message's text, one string per part as sent (a string content is one part); images are refused."""
    content = message.content
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    refuse_images(index, message)
    return [part.text for part in content if isinstance(part, TextPart)]


def message_text(index: int, message: ChatMessage) -> str:
    """A message's content as one string (text parts joined by "\\n"); images are refused (text-only models)."""
    return "\n".join(text_parts(index, message))


def tool_as_sent(tool: ToolDefinition) -> dict[str, Any]:
    """An OpenAI tool object with the fields the client gave (None fields left out)."""
    function: dict[str, Any] = {"name": tool.function.name}
    for key in ("description", "parameters", "strict"):
        value = getattr(tool.function, key)
        if value is not None:
            function[key] = value
    return {"type": tool.type, "function": function}


def tool_for_template(tool: ToolDefinition) -> dict[str, Any]:
    """An OpenAI tool object as Jinja templates expect it: `parameters` always present (templates index into it)."""
    function: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    function["parameters"] = tool.function.parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}
