"""String acceptance for the GBNF tests, with xgrammar as the recognizer: its EBNF reads the GBNF this emitter
writes (token references aside), and its structural-tag / JSON-schema grammars, as the local engine compiles
them (deltafin.grammar.constraints.grammar_of: JSON whitespace bounded as llama.cpp bounds it), are the
reference semantics."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import xgrammar as xgr

from deltafin.grammar.constraints import grammar_of, json_schema, structural_tag
from deltafin.grammar.gbnf.rules import literal

_COMPILER = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)


class Recognizer:
    def __init__(self, grammar: xgr.Grammar) -> None:
        self.compiled = _COMPILER.compile_grammar(grammar)

    def __call__(self, text: str) -> bool:
        matcher = xgr.GrammarMatcher(self.compiled, terminate_without_stop_token=True)
        return matcher.accept_string(text) and matcher.is_terminated()


def gbnf_recognizer(gbnf: str, special_tokens: Mapping[str, int] | None = None) -> Recognizer:
    """`<[ID]>` elements (which xgrammar's EBNF lacks) are read as their token's text: the language of the
    grammar over text, which is what a parser downstream sees."""
    texts = {i: t for t, i in (special_tokens or {}).items()}
    ebnf = re.sub(r"<\[(\d+)\]>", lambda m: literal(texts[int(m.group(1))]), gbnf)
    return Recognizer(xgr.Grammar.from_ebnf(ebnf, root_rule_name="root"))


def tag_recognizer(tag: dict[str, Any]) -> Recognizer:
    return Recognizer(grammar_of(structural_tag(tag)))


def schema_recognizer(schema: Any) -> Recognizer:
    return Recognizer(grammar_of(json_schema(schema)))
