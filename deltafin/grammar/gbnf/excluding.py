"""Free text that contains none of a set of strings, optionally closed by an end string.

GBNF has no lookahead, so "no occurrence of S" is spelled as the string-matching automaton (Aho-Corasick over
the excluded strings): one rule per state, named by the longest suffix of the text so far that is a prefix of
some excluded string; a character that would complete an excluded string has no transition. An end string
may follow only from states where writing it completes no excluded string that starts inside the text:
otherwise `text + end` would contain the end (or a marker) earlier than where the grammar placed it, and the
parser downstream would cut the value there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deltafin.grammar.gbnf.rules import ANY_CHAR, EMPTY, Rules, char_class, chars_class


@dataclass(frozen=True)
class TextKind:
    """One step of the text: a character outside `forbid`, or an `escape` sequence (which no marker contains)."""

    forbid: tuple[tuple[str, str], ...] = ()
    escape: str | None = None


FREE_TEXT = TextKind()
#: the inside of a JSON string: no raw quote, backslash or control character; escapes written out
JSON_STRING = TextKind((('"', '"'), ("\\", "\\"), ("\x00", "\x1f")), '"\\\\" (["\\\\/bfnrt] | "u" [0-9a-fA-F]{4})')


def excluding(rules: Rules, excludes: Sequence[str], ends: Sequence[str] = (), kind: TextKind = FREE_TEXT) -> str:
    """A rule: text free of `excludes`, of the grammar's control-token markers and of every end, then one of
    `ends` (nothing when `ends` is empty)."""
    ends = [e for e in dict.fromkeys(ends) if e]
    patterns = [p for p in dict.fromkeys([*excludes, *rules.markers, *ends]) if p]
    if not patterns and kind == FREE_TEXT:
        return rules.add("any-text", f"{ANY_CHAR}*")
    key = ("excluding", frozenset(patterns), tuple(ends), kind)
    if key not in rules.built:
        rules.built[key] = _automaton(rules, patterns, ends, kind)
    return rules.built[key]


def _automaton(rules: Rules, patterns: list[str], ends: list[str], kind: TextKind) -> str:
    prefixes = {p[:i] for p in patterns for i in range(len(p) + 1)}
    alphabet = sorted({c for p in patterns for c in p})

    def step(state: str, c: str) -> str:
        text = state + c
        return next(text[i:] for i in range(len(text) + 1) if text[i:] in prefixes)

    def dead(state: str) -> bool:
        return any(state.endswith(p) for p in patterns)

    def may_end(state: str, end: str) -> bool:
        text = state + end
        return not any(text.startswith(p, i) for i in range(len(state)) for p in patterns)

    def allowed(c: str) -> bool:
        return not any(low <= c <= high for low, high in kind.forbid)

    states = sorted((s for s in prefixes if not dead(s)), key=lambda s: (len(s), s))
    names = {s: rules.reserve("text" if not s else "text-after") for s in states}
    for state in states:
        alternatives = [rules.text(end) for end in ends if may_end(state, end)] if ends else [EMPTY]
        targets: dict[str, list[str]] = {}
        for c in filter(allowed, alphabet):
            target = step(state, c)
            if not dead(target):
                targets.setdefault(target, []).append(c)
        # every character outside the patterns' alphabet (and allowed at all) leads back to the start state
        back = [(c, c) for c in sorted(set(alphabet) - set(targets.pop("", [])))] + list(kind.forbid)
        alternatives.append(f"{char_class(back, negate=True) if back else ANY_CHAR} {names['']}")
        if kind.escape:
            alternatives.append(f"{kind.escape} {names['']}")
        alternatives += [f"{chars_class(chars)} {names[target]}" for target, chars in targets.items()]
        rules.define(names[state], " | ".join(alternatives))
    return names[""]
