"""Chat formats: render OpenAI messages (and tools) to token ids with the checkpoint's Jinja template.

Control tokens may come only from the template. Every piece of message text is swapped for a sentinel
before rendering; the rendered string is then tokenized piece by piece: template text with special
tokens recognised, message text with `split_special_tokens`, so `<|im_start|>` typed by a user stays text.

Since the template sees only sentinels, its output is a function of the conversation's shape (roles, names,
tool calls, the number of text pieces), the tools and the template arguments: renders are kept per shape
(`RenderCache`), and a request whose shape was seen before is not templated again.
"""

from __future__ import annotations

import json
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import msgspec

from deltafin.errors import InvalidRequestError
from deltafin.prompt.format import NO_OPTIONS, PromptOptions, RenderedPrompt, message_text, tool_for_template
from deltafin.prompt.sandbox import render_bounded
from deltafin.protocol.chat import ChatMessage, TextPart, ToolDefinition
from deltafin.token_codec import TokenCodec


class TemplateChatFormat:
    """The checkpoint's own chat template (`tokenizer.chat_template`)."""

    def __init__(self, tokenizer: Any, *, content_format: str, default_kwargs: dict[str, Any]) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("model.chat_format=template but the checkpoint has no chat template")
        self._tokenizer = tokenizer
        self._codec = TokenCodec(tokenizer)
        self._content_format = content_format
        self._default_kwargs = dict(default_kwargs)
        self._renders = RenderCache() if RenderCache.deterministic(tokenizer.chat_template) else None

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolDefinition] | None,
        template_kwargs: dict[str, Any],
        *,
        add_generation_prompt: bool = True,
        options: PromptOptions = NO_OPTIONS,
    ) -> RenderedPrompt:
        # Plain ASCII sentinels survive whatever a template does to a string (repr of a dict, tojson); the
        # per-render nonce keeps a client from typing one.
        nonce = secrets.token_hex(6)
        texts: list[str] = []
        conversation = [self._template_message(i, m, texts, nonce) for i, m in enumerate(messages)]
        kwargs = {**self._default_kwargs, **template_kwargs}
        cache = self._renders if "chat_template" not in kwargs else None  # a request's own template: not kept
        key = cache.key(conversation, tools, kwargs, add_generation_prompt, nonce) if cache is not None else None
        pieces = cache.get(key) if key is not None else None
        if pieces is None:
            pieces = _split_sentinels(self._apply(conversation, tools, kwargs, add_generation_prompt), nonce)
            if key is not None:
                cache.put(key, pieces)
        token_ids: list[int] = []
        text_parts: list[str] = []
        codec = self._codec
        for index, piece in enumerate(pieces):
            if index % 2 == 0:
                token_ids += codec.encode_template(piece)
                text_parts.append(piece)
            else:
                content = texts[int(piece)]
                token_ids += codec.encode(content, split_special_tokens=True)
                text_parts.append(content)
        return RenderedPrompt(token_ids, "".join(text_parts))

    def _apply(
        self, conversation: list[dict[str, Any]], tools: Sequence[ToolDefinition] | None, kwargs: dict[str, Any], gen: bool
    ) -> str:
        from jinja2 import TemplateError

        tool_dicts = [tool_for_template(t) for t in tools] if tools else None
        try:
            # Bounded in time and size: the template is code, and a request may bring its own (sandbox.py).
            return render_bounded(
                lambda: self._tokenizer.apply_chat_template(
                    conversation, tools=tool_dicts, add_generation_prompt=gen, tokenize=False, **kwargs
                )
            )
        except (TemplateError, TypeError, ValueError, KeyError) as exc:
            # Templates raise on conversations they do not support (e.g. role order); that is the client's input.
            raise InvalidRequestError(f"the chat template rejected these messages: {exc}", param="messages") from None

    def _template_message(self, index: int, message: ChatMessage, texts: list[str], nonce: str) -> dict[str, Any]:
        def placeholder(text: str) -> str:
            texts.append(text)
            return f"<<dfx{nonce}:{len(texts) - 1}>>"

        out: dict[str, Any] = {"role": message.role, "content": self._content(index, message, placeholder)}
        if message.name is not None:
            out["name"] = message.name
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None:
            out["reasoning_content"] = placeholder(message.reasoning_content)
        if message.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
                }
                for call in message.tool_calls
            ]
        return out

    def _content(self, index: int, message: ChatMessage, placeholder: Callable[[str], str]) -> Any:
        if self._content_format == "string" or not isinstance(message.content, list):
            return placeholder(message_text(index, message)) if message.content is not None else ""
        message_text(index, message)  # refuses images
        return [{"type": "text", "text": placeholder(part.text)} for part in message.content if isinstance(part, TextPart)]


class RenderCache:
    """Rendered templates (split at the sentinels, so free of any nonce) by conversation shape: the template
    arguments with every text swapped for its sentinel, as JSON with the nonce taken out. Bounded in entries
    and in the characters of one entry (large tool lists are rendered each time)."""

    MAX_ENTRIES = 256
    MAX_CHARS = 64 * 1024

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, tuple[str, ...]] = OrderedDict()

    @staticmethod
    def deterministic(template: Any) -> bool:
        """Whether the template's output depends on its arguments alone: not on the clock (`strftime_now`, as
        in Llama 3.1's "Today Date") or chance (Jinja's `lipsum`). Several named templates: not kept."""
        return isinstance(template, str) and "strftime_now" not in template and "lipsum" not in template

    @staticmethod
    def key(conversation: list[dict[str, Any]], tools: Sequence[ToolDefinition] | None, kwargs: dict[str, Any],
            add_generation_prompt: bool, nonce: str) -> bytes | None:
        tool_dicts = [tool_for_template(t) for t in tools] if tools else None
        try:
            encoded = _encode_key([conversation, tool_dicts, kwargs, add_generation_prompt])
        except (TypeError, ValueError, OverflowError):  # an argument JSON cannot spell: render it every time
            return None
        return encoded.replace(nonce.encode("ascii"), b"")

    def get(self, key: bytes) -> list[str] | None:
        pieces = self._entries.get(key)
        if pieces is None:
            return None
        self._entries.move_to_end(key)
        return list(pieces)

    def put(self, key: bytes, pieces: list[str]) -> None:
        if sum(map(len, pieces)) > self.MAX_CHARS:
            return
        self._entries[key] = tuple(pieces)
        if len(self._entries) > self.MAX_ENTRIES:
            self._entries.popitem(last=False)


_encode_key = msgspec.json.Encoder(order="deterministic").encode


def _split_sentinels(rendered: str, nonce: str) -> list[str]:
    """Template text and sentinel numbers, alternating (as `re.split` with one group would give, without
    compiling a pattern for every render's nonce). A template may drop a text (e.g. reasoning in history) or
    repeat it, but one that cut into a sentinel leaves its nonce behind: refused."""
    head = f"<<dfx{nonce}:"
    parts = rendered.split(head)
    pieces = [parts[0]]
    for part in parts[1:]:
        number, closed, rest = part.partition(">>")
        if not closed or not (number.isascii() and number.isdigit()):
            raise _altered()
        pieces += (number, rest)
    if any(nonce in piece for piece in pieces[0::2]):
        raise _altered()
    return pieces


def _altered() -> InvalidRequestError:
    return InvalidRequestError("the chat template altered message content; it cannot be rendered safely")


def _arguments(arguments: str | dict[str, Any]) -> dict[str, Any] | str:
    """Templates index into arguments; give them an object when the client sent a JSON string of one."""
    if isinstance(arguments, dict):
        return arguments
    try:
        decoded = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return arguments
    return decoded if isinstance(decoded, dict) else arguments


