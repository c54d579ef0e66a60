"""A llama.cpp GBNF grammar under construction: named rules, escaped literals and character classes.

GBNF facts this relies on (llama.cpp `src/llama-grammar.cpp`, `grammars/README.md`): rule names are
`[a-zA-Z0-9-]+`, `root` is the start; string and class escapes are `\\xHH \\uHHHH \\UHHHHHHHH \\t \\r \\n` and a
backslash before `\\ " [ ] -`; `<[ID]>` matches exactly the token ID (special tokens included).
A special token's text also matches a character-level literal, because the grammar compares each candidate
token's piece rendered *with* special tokens; `<[ID]>` is what forbids spelling a marker out of plain tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

#: literals escape everything outside printable ASCII, so the grammar text is ASCII whatever the schema holds
_PLAIN = {chr(c) for c in range(0x20, 0x7F)} - {"\\", '"'}
_CLASS_PLAIN = {chr(c) for c in range(0x20, 0x7F)} - {"\\", '"', "[", "]", "-", "^"}


def escape_char(c: str, plain: set[str]) -> str:
    if c in plain:
        return c
    if c in '\\"[]-':
        return "\\" + c
    code = ord(c)
    if c == "\n":
        return "\\n"
    if c == "\t":
        return "\\t"
    if c == "\r":
        return "\\r"
    if code < 0x100:
        return f"\\x{code:02X}"
    return f"\\u{code:04X}" if code < 0x10000 else f"\\U{code:08X}"


def literal(text: str) -> str:
    return '"' + "".join(escape_char(c, _PLAIN) for c in text) + '"'


def char_class(ranges: Iterable[tuple[str, str]], negate: bool = False) -> str:
    """`[...]` of (low, high) code point ranges; `negate` gives `[^...]`."""
    parts = []
    for low, high in ranges:
        one = escape_char(low, _CLASS_PLAIN)
        parts.append(one if low == high else f"{one}-{escape_char(high, _CLASS_PLAIN)}")
    return "[" + ("^" if negate else "") + "".join(parts) + "]"


def chars_class(chars: Iterable[str], negate: bool = False) -> str:
    return char_class(((c, c) for c in sorted(set(chars))), negate)


#: any one character; GBNF's `.` is avoided so that xgrammar's EBNF parser (used in tests) reads the same text
ANY_CHAR = "[^\\x00]"
EMPTY = '""'


class Rules:
    """Rules by name, in definition order. Identical bodies share one rule."""

    def __init__(self, special_tokens: Mapping[str, int] | None = None, markers: Iterable[str] = ()) -> None:
        """markers: control-token texts free text must not contain (llama.cpp matches a control token by its
        text wherever characters are expected, where xgrammar never lets one into text)."""
        self.markers = tuple(markers)
        self._bodies: dict[str, str | None] = {}
        self._by_body: dict[str, str] = {}
        #: rule families built once per grammar (a text automaton per set of markers, the any-JSON value),
        #: keyed by what they depend on: twenty string arguments with the same markers share one automaton
        self.built: dict[object, str] = {}
        # longest first, so `<|tool_calls_section_begin|>` wins over any shorter token it starts with
        self._specials = sorted((special_tokens or {}).items(), key=lambda item: -len(item[0]))

    def reserve(self, hint: str) -> str:
        """A fresh name whose body comes later (`define`): recursive rules need their name first."""
        base = re.sub(r"[^a-zA-Z0-9-]+", "-", hint).strip("-").lower() or "r"
        name, n = base, 1
        while name in self._bodies or name == "root":
            n += 1
            name = f"{base}-{n}"
        self._bodies[name] = None
        return name

    def define(self, name: str, body: str) -> str:
        self._bodies[name] = body
        return name

    def add(self, hint: str, body: str) -> str:
        """The name of a rule with `body`, reusing an earlier identical one."""
        if body in self._by_body:
            return self._by_body[body]
        name = self.define(self.reserve(hint), body)
        self._by_body[body] = name
        return name

    def text(self, text: str) -> str:
        """`text` as a sequence: special-token spellings as `<[ID]>`, the rest as literals."""
        if not text:
            return EMPTY
        pieces: list[str] = []
        start = i = 0
        while i < len(text):
            hit = next(((s, t) for s, t in self._specials if s and text.startswith(s, i)), None)
            if hit is None:
                i += 1
                continue
            if start < i:
                pieces.append(literal(text[start:i]))
            pieces.append(f"<[{hit[1]}]>")
            i = start = i + len(hit[0])
        if start < len(text):
            pieces.append(literal(text[start:]))
        return " ".join(pieces)

    def token(self, token: int | str) -> str:
        if isinstance(token, int) and not isinstance(token, bool) and token >= 0:
            return f"<[{token}]>"
        ids = dict(self._specials)
        if isinstance(token, str) and token in ids:
            return f"<[{ids[token]}]>"
        raise ValueError(f"token {token!r} is not a special token of this model's vocabulary")

    def render(self, root: str) -> str:
        lines = [f"root ::= {root}"]
        for name, body in self._bodies.items():
            if body is None:
                raise AssertionError(f"rule {name} reserved but never defined")
            lines.append(f"{name} ::= {body}")
        return "\n".join(lines) + "\n"
