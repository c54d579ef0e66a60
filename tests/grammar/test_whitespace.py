"""deltafin.grammar.whitespace: the grammars the local engine compiles hold JSON whitespace to llama.cpp's rule, for
every kind of constraint and every markup's forced calls, and the rewrite leaves the rest of the grammar alone."""

from __future__ import annotations

import json
import re

import pytest
import xgrammar as xgr

from deltafin.grammar.constraints import grammar_of, json_object, json_schema, structural_tag
from deltafin.grammar.whitespace import rewritten
from deltafin.markup import MARKUPS
from deltafin.markup.selection import forced_calls
from tests.grammar.gbnf_oracle import Recognizer
from tests.grammar.tools import TIME, WEATHER

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "array", "items": {"type": "integer"}}},
    "required": ["city"],
}
ALLOWED = [
    '{"city":"x"}',
    '{ "city": "x", "days": [1, 2] }',
    '{\n  "city": "x",\n  "days": [\n    1,\n    2\n  ]\n}',
    '{"city":\n\n\t\t"x"}',
    '{"city":\n' + " " * 20 + '"x"}',
]
REFUSED = [
    '{"city":\r\n"x"}',  # no carriage return
    '{"city":\n\n\n"x"}',  # at most two newlines
    '{"city":\n' + " " * 21 + '"x"}',  # at most 20 spaces or tabs after them
    '{"city":  "x"}',  # one space, or a newline first
    '{"city":\t"x"}',
]
#: xgrammar's JSON whitespace class, which the rewrite replaces everywhere
ANY_RUN = re.compile(r"\[ \\n\\r\\t\]")


@pytest.mark.parametrize("text", ALLOWED + REFUSED)
def test_a_json_schema_constraint_takes_llama_cpps_whitespace(text):
    assert Recognizer(grammar_of(json_schema(SCHEMA)))(text) == (text in ALLOWED)


def test_json_object_too():
    accepts = Recognizer(grammar_of(json_object()))
    assert accepts('{\n  "a": [1, 2]\n}') and not accepts('{"a":\r\n1}')


@pytest.mark.parametrize(("name", "mode"), [(n, mode) for n, m in sorted(MARKUPS.items()) for mode in m.prompt_endings])
def test_every_markups_forced_calls_keep_no_free_whitespace_run(name, mode):
    """Two tools: two `json_schema` elements in one tag, each with its own rules (`whitespace_1_2`...)."""
    markup = MARKUPS[name]
    tag = markup.calls(forced_calls([WEATHER, TIME], "required"), mode)
    assert not ANY_RUN.search(str(grammar_of(structural_tag(tag))))


def test_the_rewrite_reads_back_as_the_same_grammar_elsewhere():
    """What is not JSON whitespace prints the same after the rewrite (xgrammar's EBNF reads its own print)."""
    tag = MARKUPS["kimi_k2"].calls(forced_calls([WEATHER], "required"), "enabled")
    before = str(xgr.Grammar.from_structural_tag(json.dumps(tag)))
    after = str(grammar_of(structural_tag(tag)))
    untouched = [line for line in before.splitlines() if "whitespace" not in line]
    assert len(untouched) > 10
    # the only change xgrammar's own printer makes on a read back: an empty string before a rule reference
    assert all(line.replace('(("" ', "((") in after for line in untouched)


def test_a_grammar_without_json_is_left_as_it_is():
    text = 'root ::= (("a" [0-9]))'
    assert rewritten(text) is text
