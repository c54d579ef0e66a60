"""A regular expression (the subset tool schemas and Deltafin's own formats use) as a GBNF expression.

The whole text must match, as in xgrammar (a leading `^` and trailing `$` are accepted and mean nothing more).
Supported: literals and escapes, `.`, classes with ranges and `\\d \\w \\s` (negated too), groups (`(...)`,
`(?:...)`), `|`, and the quantifiers `* + ? {m} {m,} {m,n}` (lazy forms match the same strings). Anything
else (lookaround, backreferences, word boundaries, anchors inside the pattern) is a ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltafin.grammar.gbnf.rules import EMPTY, char_class, literal

_DIGIT = [("0", "9")]
_WORD = [("a", "z"), ("A", "Z"), ("0", "9"), ("_", "_")]
_SPACE = [(c, c) for c in " \t\n\r\f\v"]
_CLASSES = {
    "d": (_DIGIT, False),
    "D": (_DIGIT, True),
    "w": (_WORD, False),
    "W": (_WORD, True),
    "s": (_SPACE, False),
    "S": (_SPACE, True),
}
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}


@dataclass
class _Context:
    pattern: str
    #: characters a negated class or `.` must still leave out (a JSON string's quote, backslash, controls)
    forbid: list[tuple[str, str]]


def regex_expr(pattern: str, forbid: list[tuple[str, str]] | None = None) -> str:
    parser = _Parser(_Context(pattern, forbid or []))
    body = pattern[1:] if pattern.startswith("^") else pattern
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    parser.text, parser.pos = body, 0
    expr = parser.alternation()
    if parser.pos != len(body):
        parser.fail(f"unexpected {body[parser.pos]!r}")
    return expr


class _Parser:
    def __init__(self, context: _Context) -> None:
        self.context = context
        self.text = ""
        self.pos = 0

    def fail(self, why: str) -> None:
        raise ValueError(f"regex {self.context.pattern!r} has no grammar form: {why}")

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def alternation(self) -> str:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else "(" + " | ".join(branches) + ")"

    def sequence(self) -> str:
        items: list[str] = []
        while self.peek() not in ("", "|", ")"):
            items.append(self.quantified(self.atom()))
        return "(" + " ".join(items) + ")" if len(items) > 1 else (items[0] if items else EMPTY)

    def quantified(self, atom: str) -> str:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.pos += 1
            suffix = c
        elif c == "{" and self._counted():
            end = self.text.index("}", self.pos)
            suffix = self.text[self.pos : end + 1].replace("{,", "{0,")  # `{,n}` is `{0,n}`, as in Python
            self.pos = end + 1
        else:
            return atom
        if self.peek() == "?":
            self.pos += 1  # lazy: same language
        elif self.peek() == "+":
            self.fail("possessive quantifiers")
        return f"{atom}{suffix}"

    def _counted(self) -> bool:
        end = self.text.find("}", self.pos)
        inner = self.text[self.pos + 1 : end] if end > 0 else ""
        low, comma, high = inner.partition(",")
        if not low:  # `{,n}` needs its n
            return comma == "," and high.isdigit()
        return low.isdigit() and (not high or high.isdigit())

    def atom(self) -> str:
        c = self.peek()
        self.pos += 1
        if c == "(":
            if self.text.startswith("?:", self.pos):
                self.pos += 2
            elif self.peek() == "?":
                self.fail("lookaround and named groups")
            inner = self.alternation()
            if self.peek() != ")":
                self.fail("unbalanced parenthesis")
            self.pos += 1
            return f"({inner})"
        if c == "[":
            return self.klass()
        if c == ".":
            return char_class([("\n", "\n"), *self.context.forbid], negate=True)
        if c == "\\":
            return self.escape()
        if c in ("^", "$"):
            self.fail("anchors inside the pattern")
        if c in ("*", "+", "?"):
            self.fail(f"nothing to repeat before {c!r}")
        return self.char_literal(c)

    def char_literal(self, c: str) -> str:
        if any(low <= c <= high for low, high in self.context.forbid):
            self.fail(f"{c!r} cannot stand unescaped in a JSON string")
        return literal(c)

    def escape(self) -> str:
        c = self.peek()
        self.pos += 1
        if not c:
            self.fail("trailing backslash")
        if c in _CLASSES:
            ranges, negate = _CLASSES[c]
            return (
                char_class(ranges + (self.context.forbid if negate else []), negate) if negate else char_class(ranges)
            )
        if c in "bBAzZ" or c.isdigit() and c != "0":
            self.fail(f"\\{c}")
        return self.char_literal(self.escaped_char(c))

    def escaped_char(self, c: str) -> str:
        if c in _ESCAPES:
            return _ESCAPES[c]
        if c in ("x", "u"):
            size = 2 if c == "x" else 4
            digits = self.text[self.pos : self.pos + size]
            if len(digits) != size or any(d not in "0123456789abcdefABCDEF" for d in digits):
                self.fail(f"\\{c} needs {size} hex digits")
            self.pos += size
            return chr(int(digits, 16))
        if not c:
            self.fail("trailing backslash")
        return c

    def klass(self) -> str:
        negate = self.peek() == "^"
        if negate:
            self.pos += 1
        ranges: list[tuple[str, str]] = []
        first = True
        while first or self.peek() != "]":
            first = False
            c = self.peek()
            if not c:
                self.fail("unterminated character class")
            self.pos += 1
            if c == "\\":
                e = self.peek()
                if e in _CLASSES and not _CLASSES[e][1]:
                    self.pos += 1
                    ranges += _CLASSES[e][0]
                    continue
                if e in _CLASSES:
                    self.fail(f"\\{e} inside a class")
                self.pos += 1
                c = self.escaped_char(e)
            if self.peek() == "-" and self.text[self.pos + 1 : self.pos + 2] not in ("]", ""):
                self.pos += 1
                high = self.peek()
                self.pos += 1
                if high == "\\":
                    e = self.peek()
                    self.pos += 1
                    high = self.escaped_char(e)
                ranges.append((c, high))
            else:
                ranges.append((c, c))
        self.pos += 1
        if negate:
            return char_class(ranges + self.context.forbid, negate=True)
        for low, high in ranges:
            if any(not (high < f_low or low > f_high) for f_low, f_high in self.context.forbid):
                self.fail("a class that admits a JSON string's quote, backslash or control character")
        return char_class(ranges)
