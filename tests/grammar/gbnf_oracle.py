"""String acceptance for the GBNF tests, with xgrammar as the recognizer: its EBNF reads the GBNF this emitter
writes (token references aside), and its structural-tag / JSON-schema grammars are the reference semantics."""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr

_COMPILER = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)


class Recognizer:
    def __init__(self, grammar: xgr.Grammar) -> None:
        self.compiled = _COMPILER.compile_grammar(grammar)

    def __call__(self, text: str) -> bool:
        matcher = xgr.GrammarMatcher(self.compiled, terminate_without_stop_token=True)
        return matcher.accept_string(text) and matcher.is_terminated()


def gbnf_recognizer(gbnf: str) -> Recognizer:
    return Recognizer(xgr.Grammar.from_ebnf(gbnf, root_rule_name="root"))


def tag_recognizer(tag: dict[str, Any]) -> Recognizer:
    return Recognizer(xgr.Grammar.from_structural_tag(json.dumps(tag)))


def schema_recognizer(schema: Any, max_whitespace: int = 20) -> Recognizer:
    return Recognizer(xgr.Grammar.from_json_schema(json.dumps(schema), max_whitespace_cnt=max_whitespace))
