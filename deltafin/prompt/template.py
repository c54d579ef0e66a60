"""The checkpoint's own chat template (`tokenizer.chat_template`), rendered as itself, with control tokens only
from the template.

The template sees the real messages, so whatever string work it does on them (`content.strip()`, a `/nothink`
check, `<think>` taken out of history) gives exactly what `apply_chat_template` gives. What it may not do is let a
client's text become control tokens. So before the template is compiled, every control token written by its own
literal text where that text is output (raw template text, and string constants that reach the output through
`+`, `~`, `{% set %}` and the like, but not constants a template only compares with or splits on) is replaced by
a per-render marker. After the render the markers are the control tokens; everything else, including any
control-token text that came from a message, a tool or a template argument, is tokenized as plain text. The text
between two markers is tokenized whole, as the tokenizer would tokenize the rendered string itself.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import nodes

from deltafin.errors import InvalidRequestError
from deltafin.prompt.format import NO_OPTIONS, PromptOptions, RenderedPrompt, message_text, tool_for_template
from deltafin.prompt.plain_text import PlainText
from deltafin.prompt.sandbox import render_bounded
from deltafin.protocol.chat import ChatMessage, TextPart, ToolDefinition
from deltafin.token_codec import TokenCodec

#: the template variable holding this render's markers (one per control token); never a name a template uses
MARKS = "__deltafin_control_marks"
#: markers are private-use characters around a per-render nonce: nothing a template does to text changes them
_OPEN_MARK, _CLOSE_MARK = "\ue000", "\ue001"
#: a value that a node passes on to its parent (so a control token in it is output when the parent is)
_VALUE_FIELDS: dict[type, tuple[str, ...]] = {
    nodes.Output: ("nodes",),
    nodes.Assign: ("node",),
    nodes.Add: ("left", "right"),
    nodes.Concat: ("nodes",),
    nodes.CondExpr: ("expr1", "expr2"),
    nodes.Or: ("left", "right"),
    nodes.And: ("right",),
    nodes.MarkSafe: ("expr",),
    nodes.MarkSafeIfAutoescape: ("expr",),
}
_VALUE_FILTERS = {"string", "safe", "trim", "e", "escape"}
#: marker nonces: unpredictable to clients, who never see one (a template error naming one is cleaned), without a
#: system call per render
_NONCES = random.Random(os.urandom(32))
_MARKER = re.compile(f"{_OPEN_MARK}[0-9]+\\.[0-9]+{_CLOSE_MARK}")


def control_strings(tokenizer: Any, source: str) -> list[str]:
    """The tokens this template writes as control tokens: the special ones, and the other added tokens its literal
    text holds (Qwen3's `<tool_call>` is not special, but it is markup), whitespace tokens excepted (as
    transformers' `sanitize_control_tokens` infers them)."""
    tokens = (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
    literals = _literal_text(source)
    found = {t.content for t in tokens if t.special or (t.content in literals and not t.content.isspace())}
    return sorted(found, key=len, reverse=True)  # a longer token wins over one it contains


def _literal_text(source: str) -> str:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    ast = _compile_jinja_template(source).environment.parse(source)
    literals = {node.data for node in ast.find_all(nodes.TemplateData)}
    literals |= {node.value for node in ast.find_all(nodes.Const) if isinstance(node.value, str)}
    return "\0".join(literals)


@dataclass(frozen=True)
class MarkedTemplate:
    template: Any  # the compiled jinja2 Template, control tokens of its output literals as markers
    original: Any  # the template as written
    controls: tuple[str, ...]  # marker k stands for controls[k]
    # A marked literal is stored ({% set %}, a macro's or a block's output) before it is output: the template may
    # still do string work on it (split on `</think>`), so each render is checked against the original's.
    stored: bool


def mark_controls(source: str, controls: Sequence[str]) -> MarkedTemplate:
    """The template compiled (with transformers' environment: its sandbox, filters and globals) after every
    control token of its output literals was replaced by `MARKS[k]`."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    original = _compile_jinja_template(source)
    env = original.environment
    ast = env.parse(source)
    marker = _Marker(controls)
    if controls:
        marker.visit(ast, False, False)
        ast.set_environment(env)
    return MarkedTemplate(env.from_string(ast), original, tuple(controls), marker.stored)


class _Marker:
    def __init__(self, controls: Sequence[str]) -> None:
        self._pattern = re.compile("(" + "|".join(map(re.escape, controls)) + ")") if controls else None
        self._index = {token: k for k, token in enumerate(controls)}
        self.stored = False

    def visit(self, node: nodes.Node, output: bool, stored: bool) -> nodes.Node | list[nodes.Node]:
        if isinstance(node, nodes.TemplateData):  # raw template text: always output
            pieces = self._pieces(node.data, node.lineno, nodes.TemplateData)
            self.stored |= stored and bool(pieces)
            return [*pieces] or [node]
        if isinstance(node, nodes.Const) and output and isinstance(node.value, str):
            pieces = self._pieces(node.value, node.lineno, nodes.Const)
            self.stored |= stored and bool(pieces)
            return nodes.Concat(pieces, lineno=node.lineno) if pieces else node
        stored = stored or isinstance(node, (nodes.Assign, nodes.AssignBlock, nodes.Macro, nodes.CallBlock))
        passing = _VALUE_FIELDS.get(type(node), ())
        if isinstance(node, nodes.Filter) and node.name in _VALUE_FILTERS:
            passing = ("node",)
        # Statements that output or store a value (Output, Assign) make it output; an expression passes on what it got.
        passes = output or isinstance(node, (nodes.Output, nodes.Assign))
        for field in node.fields:
            value = getattr(node, field)
            child_output = passes and field in passing
            if isinstance(value, nodes.Node):
                marked = self.visit(value, child_output, stored)
                setattr(node, field, nodes.Concat(marked, lineno=node.lineno) if isinstance(marked, list) else marked)
            elif isinstance(value, list):
                items: list[Any] = []
                for item in value:
                    marked = self.visit(item, child_output, stored) if isinstance(item, nodes.Node) else item
                    items += marked if isinstance(marked, list) else [marked]
                setattr(node, field, items)
        return node

    def _pieces(self, text: str, lineno: int, literal: type) -> list[nodes.Expr]:
        """`text` as literal pieces and markers; [] when it holds no control token."""
        if self._pattern is None:
            return []
        parts = self._pattern.split(text)
        if len(parts) == 1:
            return []
        out: list[nodes.Expr] = []
        for i, part in enumerate(parts):
            if i % 2:
                marker = nodes.Getitem(nodes.Name(MARKS, "load"), nodes.Const(self._index[part]), "load")
                out.append(marker.set_lineno(lineno))  # type: ignore[arg-type]  # set_lineno returns the node itself
            elif part:
                out.append(literal(part, lineno=lineno))
        return out


class TemplateChatFormat:
    """The checkpoint's own chat template (`tokenizer.chat_template`)."""

    MAX_COMPILED = 16

    def __init__(self, tokenizer: Any, *, content_format: str, default_kwargs: dict[str, Any]) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("model.chat_format=template but the checkpoint has no chat template")
        self._tokenizer = tokenizer
        self._content_format = content_format
        self._default_kwargs = dict(default_kwargs)
        from transformers.utils.chat_template_utils import _plain_template_data

        # What apply_chat_template gives every template, before the kwargs.
        self._special_tokens = _plain_template_data(dict(tokenizer.special_tokens_map))
        self._compiled: OrderedDict[str, tuple[MarkedTemplate, _PieceEncoder]] = OrderedDict()
        self._marked(tokenizer.get_chat_template(None, None))  # a template that does not compile fails at load

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolDefinition] | None,
        template_kwargs: dict[str, Any],
        *,
        add_generation_prompt: bool = True,
        options: PromptOptions = NO_OPTIONS,
    ) -> RenderedPrompt:
        kwargs = {**self._default_kwargs, **template_kwargs}
        if options.reasoning_effort is not None:  # as vLLM hands it to every template
            kwargs.setdefault("reasoning_effort", options.reasoning_effort)
        tool_dicts = [tool_for_template(t) for t in tools] if tools else None
        source = self._tokenizer.get_chat_template(kwargs.pop("chat_template", None), tool_dicts)
        marked, encoder = self._marked(source)
        conversation = [self._template_message(i, m) for i, m in enumerate(messages)]
        pieces = self._apply(marked, conversation, tool_dicts, kwargs, add_generation_prompt)
        if marked.stored:
            as_written = self._render(marked.original, conversation, tool_dicts, kwargs, add_generation_prompt, [])
            if _joined(pieces, marked.controls) != as_written:
                # The template did string work on its own marked text: render it as written, with the clients'
                # control-token text marked instead (transformers' sanitize_control_tokens, keys included).
                return encoder.sanitized(
                    self._sanitized_render(marked, conversation, tool_dicts, kwargs, add_generation_prompt)
                )
        return encoder.encode(pieces, marked.controls)

    def _marked(self, source: str) -> tuple[MarkedTemplate, _PieceEncoder]:
        entry = self._compiled.get(source)
        if entry is None:
            from jinja2 import TemplateError

            controls = control_strings(self._tokenizer, source)
            try:
                marked = mark_controls(source, controls)
            except TemplateError as exc:
                raise InvalidRequestError(f"the chat template does not compile: {exc}", param="chat_template") from None
            entry = self._compiled[source] = (marked, _PieceEncoder(self._tokenizer, controls))
            if len(self._compiled) > self.MAX_COMPILED:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(source)
        return entry

    def _apply(
        self,
        marked: MarkedTemplate,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
        gen: bool,
    ) -> list[str]:
        """The rendered text split at the markers: text, control index, text, ... (as `re.split` with one group)."""
        nonce = f"{_OPEN_MARK}{_NONCES.getrandbits(48)}."
        marks = [f"{nonce}{k}{_CLOSE_MARK}" for k in range(len(marked.controls))]
        rendered = self._render(marked.template, conversation, tools, kwargs, gen, marks)
        parts = rendered.split(nonce)
        pieces = [parts[0]]
        for part in parts[1:]:
            number, closed, rest = part.partition(_CLOSE_MARK)
            if not closed or not (number.isascii() and number.isdigit()) or int(number) >= len(marks):
                raise _altered()
            pieces += (number, rest)
        if any(nonce[1:] in piece for piece in pieces[0::2]):
            raise _altered()
        return pieces

    def _render(
        self, template: Any, conversation: Any, tools: Any, kwargs: dict[str, Any], gen: bool, marks: list[str]
    ) -> str:
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import _alias_reasoning_fields, _plain_template_data

        # What the template sees is what apply_chat_template gives it: special tokens, then the kwargs, as plain
        # data (messages and tools are built here from decoded JSON: plain already), reasoning under its aliases.
        variables = {**self._special_tokens, **_plain_template_data(kwargs)} if kwargs else self._special_tokens
        chat = _alias_reasoning_fields(conversation)
        try:
            # Bounded in time and size: the template is code, and a request may bring its own (sandbox.py).
            return render_bounded(
                lambda: template.render(
                    messages=chat,
                    tools=tools,
                    documents=None,
                    add_generation_prompt=gen,
                    **variables,
                    **{MARKS: marks},
                )
            )
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # Templates raise on conversations they do not support (e.g. role order); that is the client's input.
            message = _MARKER.sub("", str(exc))  # a marker never leaves: its nonce must stay unknown to clients
            raise InvalidRequestError(
                f"the chat template rejected these messages: {message}", param="messages"
            ) from None

    def _sanitized_render(
        self, marked: MarkedTemplate, conversation: Any, tools: Any, kwargs: dict[str, Any], gen: bool
    ) -> str:
        from transformers.utils.chat_template_utils import _get_control_token_patterns

        pattern, _ = _get_control_token_patterns(marked.controls)
        mark = lambda value: _mark_inputs(value, pattern)  # noqa: E731
        return self._render(marked.original, mark(conversation), mark(tools), mark(kwargs), gen, [])

    def _template_message(self, index: int, message: ChatMessage) -> dict[str, Any]:
        out: dict[str, Any] = {"role": message.role, "content": self._content(index, message)}
        if message.name is not None:
            out["name"] = message.name
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None:
            out["reasoning_content"] = message.reasoning_content
        if message.reasoning is not None:
            out["reasoning"] = message.reasoning  # transformers fills reasoning_content from it
        if message.tool_calls:
            out["tool_calls"] = [
                {
                    **({"id": call.id} if call.id is not None else {}),
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
                }
                for call in message.tool_calls
            ]
        return out

    def _content(self, index: int, message: ChatMessage) -> Any:
        # No content (an assistant turn of only tool calls) is "": templates concatenate and split it.
        if self._content_format == "string" or not isinstance(message.content, list):
            return message_text(index, message)
        message_text(index, message)  # refuses images
        return [{"type": "text", "text": part.text} for part in message.content if isinstance(part, TextPart)]


_KEPT_PIECE_CHARS = 4096
_KEPT_PIECES = 512


class _PieceEncoder:
    """Token ids of a render split at its markers: control tokens as their ids; the text between two markers
    tokenized whole as plain text, as the tokenizer would tokenize it between two added tokens of the rendered
    string (whitespace an added token strips is stripped; a tokenizer that adds a prefix space at the start of a
    string, as SentencePiece does, is given a newline before a piece that follows a marker, then the newline is
    taken off, as transformers' own chat encoding does)."""

    def __init__(self, tokenizer: Any, controls: Sequence[str]) -> None:
        self._plain = PlainText(tokenizer, controls)
        self._seen: dict[tuple[str, bool], tuple[int, ...]] = {}
        self._controls = tuple(controls)
        self._live = TokenCodec(tokenizer).encode_template
        self._ids = [tokenizer.convert_tokens_to_ids(token) for token in controls]
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._strips = [
            (getattr(added.get(i), "lstrip", False), getattr(added.get(i), "rstrip", False)) for i in self._ids
        ]
        self._newline = self._plain.encode("\n")
        self._prefix_space = self._newline and self._plain.encode("\na")[len(self._newline) :] != self._plain.encode(
            "a"
        )

    def encode(self, pieces: list[str], controls: Sequence[str]) -> RenderedPrompt:
        texts = pieces[0::2]
        marks = [int(number) for number in pieces[1::2]]
        token_texts = list(texts)  # what is tokenized: whitespace an added token strips removed
        for j, k in enumerate(marks):
            lstrip, rstrip = self._strips[k]
            if lstrip:
                token_texts[j] = token_texts[j].rstrip()
            if rstrip:
                token_texts[j + 1] = token_texts[j + 1].lstrip()
        ids: list[int] = []
        text: list[str] = []
        for j, piece in enumerate(texts):
            if j:
                ids.append(self._ids[marks[j - 1]])
                text.append(controls[marks[j - 1]])
            ids += self._text_ids(token_texts[j], after_marker=j > 0)
            text.append(piece)
        return RenderedPrompt(ids, "".join(text))

    def sanitized(self, rendered: str) -> RenderedPrompt:
        """A render whose clients' control-token text was wrapped in transformers' markers: that text plain, the
        rest (the template's text) with control tokens live; a lone marker (a template split a wrapped token)
        only breaks the text."""
        from transformers.utils.chat_template_utils import _get_control_token_patterns

        _, markers = _get_control_token_patterns(self._controls)
        pieces = markers.split(rendered)
        ids: list[int] = []
        for j, piece in enumerate(pieces):
            if piece:
                ids += self._plain.encode(piece) if j % 2 else self._live(piece)
        return RenderedPrompt(ids, "".join(piece for piece in pieces if piece))

    def _text_ids(self, piece: str, *, after_marker: bool) -> list[int]:
        """Ids of one piece; pieces come back request after request (the template's own text between two control
        tokens, and in a conversation every earlier turn), so short ones are kept."""
        if not piece:
            return []
        key = (piece, after_marker)
        ids = self._seen.get(key)
        if ids is None:
            ids = self._encode_piece(piece, after_marker=after_marker)
            if len(piece) <= _KEPT_PIECE_CHARS:
                if len(self._seen) >= _KEPT_PIECES:
                    self._seen.clear()  # a simple bound: the pieces in use come back at once
                self._seen[key] = ids
        return list(ids)

    def _encode_piece(self, piece: str, *, after_marker: bool) -> tuple[int, ...]:
        if after_marker and self._prefix_space:
            ids = self._plain.encode("\n" + piece)
            if ids[: len(self._newline)] == self._newline:
                return tuple(ids[len(self._newline) :])
        return tuple(self._plain.encode(piece))


def _joined(pieces: list[str], controls: Sequence[str]) -> str:
    return "".join(piece if j % 2 == 0 else controls[int(piece)] for j, piece in enumerate(pieces))


def _mark_inputs(value: Any, pattern: re.Pattern) -> Any:
    """transformers' `mark_control_tokens`, dict keys included (a tool's property names and a call's argument
    names are the client's text too)."""
    from transformers.utils.chat_template_utils import mark_control_tokens

    if isinstance(value, dict):
        return {
            mark_control_tokens(k, pattern) if isinstance(k, str) else k: _mark_inputs(v, pattern)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_mark_inputs(v, pattern) for v in value]
    return mark_control_tokens(value, pattern)


def _altered() -> InvalidRequestError:
    return InvalidRequestError("the chat template altered its own control tokens; it cannot be rendered safely")


def _arguments(arguments: str | dict[str, Any]) -> dict[str, Any] | str:
    """Templates index into arguments; give them an object when the client sent a JSON string of one (as vLLM)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        decoded = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return arguments
    return decoded if isinstance(decoded, dict) else arguments
