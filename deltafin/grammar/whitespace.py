"""JSON whitespace in xgrammar's grammars, bounded as llama.cpp's JSON grammar bounds it.

xgrammar's JSON (a `json_schema` constraint, or a structural tag's `json_schema` element in any style) allows a
run of `[ \\n\\r\\t]` between tokens, at most `max_whitespace_cnt` long: a small model stuck on whitespace writes
ten `\\r\\n` between a key and its value. Its options cannot say llama.cpp's rule (`SPACE_RULE` in
common/json-schema-to-grammar.cpp: nothing, one space, or one or two newlines and at most 20 spaces or tabs),
so the grammar xgrammar built is rewritten: every whitespace rule of its JSON becomes that rule, and the
repetition around each use of it goes. The EBNF xgrammar prints reads back as the same grammar
(tests/grammar/test_whitespace.py), so everything else is untouched. llama-server's GBNF writes the same rule
(deltafin.grammar.gbnf.json_schema), so both engines hold a model to one whitespace language.
"""

from __future__ import annotations

import re
from typing import Any

from deltafin.protocol.sampling import MAX_INDENT, MAX_NEWLINES

#: the rule in xgrammar's EBNF
SPACE = f'("" | " " | ("\\n"{{1, {MAX_NEWLINES}}} [ \\t]{{0, {MAX_INDENT}}}))'

#: how xgrammar 0.2.9 prints a JSON whitespace rule and its uses (`whitespace_3 ::= (([ \n\r\t]))`, used as
#: `whitespace_3{0, 20}`)
_DEFINITION = re.compile(r"^(whitespace(?:_\d+)*) ::= \(\(\[ \\n\\r\\t\]\)\)$", re.MULTILINE)
_USE = re.compile(r"\b(whitespace(?:_\d+)*)\{0, \d+\}")


def rewritten(ebnf: str) -> str:
    """`ebnf` (as xgrammar prints a grammar) with its JSON whitespace rules made llama.cpp's; unchanged when it
    has none."""
    names = set(_DEFINITION.findall(ebnf))
    if not names:
        return ebnf
    ebnf = _DEFINITION.sub(lambda m: f"{m[1]} ::= {SPACE}", ebnf)
    return _USE.sub(lambda m: m[1] if m[1] in names else m[0], ebnf)


def bounded(grammar: Any) -> Any:
    """The xgrammar Grammar `grammar` with llama.cpp's JSON whitespace."""
    import xgrammar as xgr

    text = str(grammar)
    ebnf = rewritten(text)
    return grammar if ebnf is text else xgr.Grammar.from_ebnf(ebnf, root_rule_name="root")
