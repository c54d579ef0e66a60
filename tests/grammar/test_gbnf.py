"""The GBNF emitter, one construct at a time: each grammar is read back by xgrammar's EBNF parser (the same
syntax as llama.cpp's GBNF) and checked against literal strings, against Python's `re` for regexes and against
xgrammar's own JSON-schema and structural-tag grammars where the semantics must agree."""

from __future__ import annotations

import functools
import re

import pytest

from deltafin.grammar.gbnf import structural_tag_to_gbnf
from deltafin.grammar.gbnf.rules import Rules, chars_class, literal
from deltafin.markup import formats as f
from tests.grammar.gbnf_oracle import gbnf_recognizer, schema_recognizer, tag_recognizer


def accepts(fmt: dict, specials: dict | None = None):
    return gbnf_recognizer(structural_tag_to_gbnf(f.structural_tag(fmt), specials))


def json_accepts(schema):
    return accepts(f.arguments(schema))


class TestRulesText:
    def test_literals_escape_quotes_backslashes_controls_and_non_ascii(self):
        assert literal('a"b\\c\n\t\u00e9\u4e2d\U0001f600') == '"a\\"b\\\\c\\n\\t\\xE9\\u4E2D\\U0001F600"'
        assert accepts(f.const('a"b\\c\n\u00e9\u4e2d\U0001f600'))('a"b\\c\n\u00e9\u4e2d\U0001f600')

    def test_class_metacharacters_are_escaped(self):
        assert chars_class("^]-\\a") == r"[\-\\\]\x5Ea]"
        one = accepts(f.regex(r"[\^\]\-\\a]"))
        assert all(one(c) for c in "^]-\\a") and not one("b")

    def test_special_tokens_become_token_ids_longest_first(self):
        rules = Rules({"<|open|>": 7, "<|open|>x": 8, "<|sep|>": 9})
        assert rules.text('<|open|>x<|open|>y "q"<|sep|>') == '<[8]> <[7]> "y \\"q\\"" <[9]>'
        assert structural_tag_to_gbnf(f.structural_tag(f.const("<|sep|>")), {"<|sep|>": 9}) == "root ::= <[9]>\n"

    def test_a_token_format_needs_an_id_or_a_known_special_token(self):
        tag = f.structural_tag({"type": "token", "token": "<|sep|>"})
        assert structural_tag_to_gbnf(tag, {"<|sep|>": 9}) == "root ::= <[9]>\n"
        with pytest.raises(ValueError, match="not a special token"):
            structural_tag_to_gbnf(tag)

    def test_one_text_automaton_per_set_of_markers(self):
        from deltafin.markup.glm import GLM47
        from deltafin.markup.selection import ForcedCalls, ForcedFunction

        schema = {"type": "object", "properties": {k: {"type": "string"} for k in "abcde"}}
        tools = tuple(ForcedFunction(f"tool_{i}", schema) for i in range(30))
        grammar = structural_tag_to_gbnf(GLM47.calls(ForcedCalls(tools, single=False), "enabled"))
        # one automaton for the reasoning (ends at </think>) and one for every string value (ends at </arg_value>)
        assert (
            len([line for line in grammar.splitlines() if line.startswith("text ::=") or line.startswith("text-")])
            < 120
        )
        assert len(grammar) < 60_000

    def test_identical_rules_are_shared(self):
        schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}
        grammar = structural_tag_to_gbnf(f.structural_tag(f.arguments(schema)))
        assert grammar.count("json-string ::=") == 1 and "json-string-2" not in grammar


class TestAnyText:
    def test_free_text_without_excludes(self):
        ok = accepts(f.sequence(f.any_text(), f.const("!")))
        assert ok("anything <at> all\n!") and ok("!")

    def test_excluded_strings_never_appear(self):
        ok = accepts(f.any_text(["<think>", "</think>", "<tool_call>"]))
        assert ok("") and ok("a <thin k> </thinker <tool and <<think") and ok("<th")
        assert not ok("a<think>") and not ok("x</think>y") and not ok("<<tool_call>")

    def test_inside_a_tag_it_runs_to_the_first_end(self):
        ok = accepts(f.tag("<a>", f.any_text(["<b>"]), "</a>"))
        assert not ok("<a>x < / </ </a") and ok("<a>x < / </ </a</a>") and ok("<a></a>")
        assert not ok("<a>x</a>y</a>") and not ok("<a><b></a>")

    def test_an_end_that_overlaps_itself_is_not_found_early(self):
        # "a" + "aa" would contain the end at 0: the value would be cut there, so the grammar refuses it
        ok = accepts(f.tag("", f.any_text(), "aa"))
        assert ok("baa") and ok("aa") and ok("abaa") and not ok("aaa")

    def test_excludes_of_the_end_itself_do_not_forbid_the_end(self):
        ok = accepts(f.tag("<v>", f.any_text(["</v>"]), "</v>\n"))
        assert ok("<v>x</v>\n") and not ok("<v>x</v>y</v>\n")

    def test_several_ends(self):
        ok = accepts({"type": "tag", "begin": "", "content": f.any_text(), "end": ["</a>", "</b>"]})
        assert ok("x</a>") and ok("x</b>") and not ok("x</a>y</b>")

    def test_special_token_end_is_a_token_and_its_text_stays_excluded(self):
        grammar = structural_tag_to_gbnf(f.structural_tag(f.tag("", f.any_text(), "<|close|>")), {"<|close|>": 5})
        assert "<[5]>" in grammar and '"<|close|>"' not in grammar

    def test_matches_xgrammar_on_the_think_prefix(self):
        fmt = f.sequence(f.tag("", f.any_text(["<think>", "</think>"]), "</think>"), f.const("X"))
        mine, ref = accepts(fmt), tag_recognizer(f.structural_tag(fmt))
        for text in [
            "</think>X",
            "hm</think>X",
            "<thi</think>X",
            "a<think>b</think>X",
            "a</think>b</think>X",
            "</think>",
        ]:
            assert mine(text) == ref(text), text

    def test_length_limits_have_no_gbnf_form(self):
        with pytest.raises(ValueError, match="max_chars"):
            structural_tag_to_gbnf(f.structural_tag({"type": "any_text", "max_chars": 3}))


REGEXES = [
    (r"[0-9]{1,4}", ["0", "1234", "12345", "", "a"]),
    (r"\n{0,2}", ["", "\n", "\n\n", "\n\n\n", " "]),
    (r"[A-Za-z0-9_.\-]{1,64}", ["a.b-c_9", "", "a b", "x" * 64, "x" * 65]),
    (r"integer|number|boolean", ["integer", "number", "bool", "integernumber"]),
    (r"^(?:ab|c)+d?$", ["ab", "cabd", "d", "abab", "abc d"]),
    (r"\d+(\.\d+)?\s\w*", ["1.5 ab_", "1. x", "12\tq", "x 1"]),
    (r"[^a-c]x.", ["dxz", "axz", "dx\n", "dx"]),
    (r"\x41\u00e9\.\*", ["Aé.*", "Aéx*"]),
    (r"a{2,}b*?c??", ["aa", "aaabbbc", "a", "aacc"]),
    (r"x{y}|{", ["x{y}", "{", "xy"]),
    (r"a{,2}b{1}c{ 1}", ["b", "aabc{ 1}", "aaab", "ab"]),
]


class TestRegex:
    @pytest.mark.parametrize(("pattern", "texts"), REGEXES)
    def test_agrees_with_python_fullmatch(self, pattern, texts):
        ok = accepts(f.regex(pattern))
        for text in texts:
            assert ok(text) == bool(re.fullmatch(pattern, text)), (pattern, text)

    @pytest.mark.parametrize(
        "pattern", [r"(?=a)a", r"(?<!a)b", r"(a)\1", r"\bword", r"a^b", r"a++", r"*a", r"(ab", r"[ab"]
    )
    def test_what_gbnf_cannot_say_is_a_value_error(self, pattern):
        with pytest.raises(ValueError, match="regex"):
            structural_tag_to_gbnf(f.structural_tag(f.regex(pattern)))


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city"],
}
SCHEMAS = [
    (
        WEATHER,
        [
            '{"city": "Paris"}',
            '{"city":"Paris","days":3}',
            '{"city": "Paris", "unit": "c"}',
            '{"city": "P", "days": -2, "unit": "f"}',
            '{"days": 3}',
            '{"city": "Paris", "unit": "k"}',
            '{"unit": "c", "city": "Paris"}',
            '{"city": "Paris", "x": 1}',
            '{ "city" : "a\\"b\\u00e9" }',
            '{"city": "Paris",}',
            '{"city": 3}',
            '{"city": "Paris", "days": 3.5}',
        ],
    ),
    ({"type": "object"}, ["{}", '{"a": [1, {"b": null}], "c": "d"}', "[]", '{"a"}']),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
        ['{"a": 1, "b": "x"}', '{"a": 1}', "{}", '{"b": true}'],
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}},
            "required": ["a"],
        },
        ['{"a": {"b": true}}', '{"a": {"b": "true"}}', '{"a": {}}'],
    ),
    (
        {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
        ["[1]", "[1, -2.5e3, 0.25]", "[]", "[1, 2, 3, 4]", "[01]"],
    ),
    ({"type": "array"}, ["[]", '[1, "a", null, [true]]']),
    ({"anyOf": [{"type": "string"}, {"type": "null"}]}, ['"x"', "null", "1"]),
    ({"oneOf": [{"const": "a"}, {"enum": [1, None, True]}]}, ['"a"', "1", "null", "true", '"b"', "2"]),
    ({"type": ["integer", "boolean"]}, ["1", "false", '"1"']),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ['"ab"', '"abc"', '"a"', '"abcd"']),
    ({"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}, ['"ab-12"', '"ab-1"', '"AB-12"']),
    ({"type": "null"}, ["null", '"null"']),
    (
        {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}}},
        ['{"days": 1}', '{"days": 7}', '{"days": 0}', '{"days": 8}', '{"days": -1}'],
    ),
    (
        {
            "type": "object",
            "properties": {"n": {"$ref": "#/$defs/node"}},
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}},
                    "required": ["v"],
                }
            },
        },
        ['{"n": {"v": 1, "next": {"v": 2}}}', '{"n": {"next": {"v": 2}}}', "{}"],
    ),
]


class TestJsonSchema:
    @pytest.mark.parametrize(("schema", "texts"), SCHEMAS)
    def test_agrees_with_xgrammar(self, schema, texts):
        mine, ref = json_accepts(schema), schema_recognizer(schema)
        for text in texts:
            assert mine(text) == ref(text), (schema, text)

    def test_excludes_keep_texts_out_of_free_strings_and_keys(self):
        schema = {
            "type": "object",
            "properties": {"a": {"type": "string"}, "b": {"enum": ["x</t>", "y"]}, "c": {"type": "object"}},
        }
        fmt = f.arguments(schema, excludes=("</t>",))
        mine, ref = accepts(fmt), tag_recognizer(f.structural_tag(fmt))
        for text in [
            '{"a": "q"}',
            '{"a": "q</t>"}',
            '{"a": "q</t"}',
            '{"b": "y"}',
            '{"b": "x</t>"}',
            '{"c": {"k</t>": 1}}',
            '{"c": {"k": "</t>"}}',
            '{"c": {"k": "<\\/t>"}}',
        ]:
            assert mine(text) == ref(text), text

    def test_whitespace_is_bounded_as_llama_cpp_bounds_it(self):
        """Between two tokens: nothing, one space, or one or two newlines and at most 20 spaces or tabs."""
        ok = json_accepts(WEATHER)
        assert ok('{"city":"x"}') and ok('{ "city": "x" }') and ok('{\n  "city":\n\n\t\t"x"\n}')
        assert ok('{"city":\n' + " " * 20 + '"x"}')
        assert not ok('{"city":\n' + " " * 21 + '"x"}')
        assert not ok('{"city":\n\n\n"x"}')
        assert not ok('{"city":  "x"}')
        assert not ok('{"city":\r\n"x"}')

    def test_integer_and_number_digits_are_bounded(self):
        ok = json_accepts({"type": "integer"})
        assert ok("9" * 16) and not ok("9" * 17) and not ok("01")

    @pytest.mark.parametrize(
        ("low", "high"),
        [(1, 7), (0, None), (None, None), (-15, 23), (-300, -7), (7, 7), (95, 1234), (None, -5), (10, None)],
    )
    def test_integer_ranges_are_exact(self, low, high):
        ok = json_accepts(
            {"type": "integer"}
            | ({} if low is None else {"minimum": low})
            | ({} if high is None else {"maximum": high})
        )
        wrong = [
            n for n in range(-1500, 1500) if ok(str(n)) != ((low is None or n >= low) and (high is None or n <= high))
        ]
        assert wrong == [] and not any(ok(s) for s in ("01", "-0", "+1", "1.0", ""))

    def test_exclusive_bounds_round_inward(self):
        ok = json_accepts({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 2.5})
        assert [n for n in range(-3, 5) if ok(str(n))] == [1, 2]

    def test_number_bounds_beyond_the_sign_are_typed_only(self):
        ok = json_accepts({"type": "number", "minimum": 0, "maximum": 1})
        assert ok("0.5") and not ok("-0.5") and ok("2.5")  # documented: only the sign follows from the bounds

    def test_an_empty_integer_range_is_a_value_error(self):
        with pytest.raises(ValueError, match="empty"):
            structural_tag_to_gbnf(f.structural_tag(f.arguments({"type": "integer", "minimum": 3, "maximum": 2})))

    def test_huge_length_bounds_are_typed_only(self):
        ok = json_accepts({"type": "string", "maxLength": 100000})
        assert ok('"' + "x" * 300 + '"')

    @pytest.mark.parametrize(
        ("schema", "message"),
        [
            ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not'"),
            ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties"),
            ({"allOf": [{"type": "string"}, {"minLength": 1}]}, "allOf"),
            ({"$ref": "https://example.com/s.json"}, "only references inside"),
            ({"$ref": "#/$defs/missing"}, "points at nothing"),
            ({"type": "date"}, "not a JSON Schema type"),
            ({"enum": []}, "enum"),
            ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "admits no value"),
            ({"type": "string", "pattern": '["]'}, "regex"),
        ],
    )
    def test_unsupported_constructs_are_value_errors_naming_them(self, schema, message):
        with pytest.raises(ValueError, match=re.escape(message) if message.startswith("'") else message):
            structural_tag_to_gbnf(f.structural_tag(f.arguments(schema)))


XML_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "x": {},
        "y": {"enum": ["a", "b"]},
    },
    "required": ["city"],
}
XML_TEXTS = {
    "glm_xml": [
        "<arg_key>city</arg_key><arg_value>Paris</arg_value>",
        "<arg_key>city</arg_key>\n<arg_value>Pa ris</arg_value>\n<arg_key>days</arg_key><arg_value> 3 </arg_value>",
        '<arg_key>city</arg_key><arg_value>P</arg_value><arg_key>tags</arg_key><arg_value>["a"]</arg_value>',
        "<arg_key>days</arg_key><arg_value>3</arg_value>",
        "<arg_key>city</arg_key><arg_value>P</arg_value><arg_key>days</arg_key><arg_value>x</arg_value>",
        "<arg_key>city</arg_key><arg_value>a</arg_value>b</arg_value>",
        "<arg_key>city</arg_key><arg_value>P</arg_value><arg_key>x</arg_key><arg_value>hi</arg_value>",
        "<arg_key>city</arg_key><arg_value>P</arg_value><arg_key>x</arg_key><arg_value> [1] </arg_value>",
        "<arg_key>city</arg_key><arg_value>P</arg_value><arg_key>y</arg_key><arg_value>a</arg_value>",
        '<arg_key>city</arg_key><arg_value>P</arg_value><arg_key>y</arg_key><arg_value>"a"</arg_value>',
    ],
    "kimi_k3_xml": [
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>',
        '<|open|>argument key="city" type="string"<|sep|>P<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>',
        '<|open|>argument key="city" type="string"<|sep|>P<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="integer"<|sep|>3<|close|>argument<|sep|>',
        '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>',
        '<|open|>argument key="city" type="string"<|sep|>P<|close|>argument<|sep|>'
        '<|open|>argument key="x" type="number"<|sep|>hi<|close|>argument<|sep|>',
        '<|open|>argument key="city" type="string"<|sep|>P<|close|>argument<|sep|>'
        '<|open|>argument key="y" type="string"<|sep|>c<|close|>argument<|sep|>',
    ],
}


class TestXmlStyles:
    @pytest.mark.parametrize("style", list(XML_TEXTS))
    def test_agree_with_xgrammar(self, style):
        fmt = f.arguments(XML_SCHEMA, style=style)
        mine, ref = accepts(fmt), tag_recognizer(f.structural_tag(fmt))
        for text in XML_TEXTS[style]:
            assert mine(text) == ref(text), (style, text)

    def test_unknown_style_and_non_object_schema_are_value_errors(self):
        with pytest.raises(ValueError, match="qwen_xml"):
            structural_tag_to_gbnf(f.structural_tag(f.arguments(XML_SCHEMA, style="qwen_xml")))
        with pytest.raises(ValueError, match="not an object"):
            structural_tag_to_gbnf(f.structural_tag(f.arguments({"type": "string"}, style="glm_xml")))


TAG_A, TAG_B = f.tag("<a>", f.const("1"), "</a>"), f.tag("<b>", f.regex("[0-9]"), "</b>")
COMBINATORS = [
    (f.one_of(f.const("x"), f.const("yz")), ["x", "yz", "xyz", ""]),
    (
        f.sequence(f.optional(f.const("x")), f.star(f.const("ab")), {"type": "plus", "content": f.const("!")}),
        ["!", "xabab!!", "x", "ab"],
    ),
    ({"type": "repeat", "min": 1, "max": 2, "content": f.const("q")}, ["q", "qq", "", "qqq"]),
    (f.calls([TAG_A, TAG_B], ",", single=False), ["<a>1</a>", "<a>1</a>,<b>7</b>,<a>1</a>", "", "<a>1</a><b>7</b>"]),
    (f.calls([TAG_A, TAG_B], "", single=True), ["<b>7</b>", "<a>1</a><b>7</b>", ""]),
    ({"type": "tags_with_separator", "tags": [TAG_A], "separator": "\n"}, ["", "<a>1</a>\n<a>1</a>"]),
]


class TestFormats:
    @pytest.mark.parametrize(("fmt", "texts"), COMBINATORS)
    def test_combinators_agree_with_xgrammar(self, fmt, texts):
        mine, ref = accepts(fmt), tag_recognizer(f.structural_tag(fmt))
        for text in texts:
            assert mine(text) == ref(text), text

    @pytest.mark.parametrize(
        "tag",
        [
            {"type": "structural_tag"},
            {"format": f.const("x")},
            '{"type": "structural_tag", "format": ',
            f.structural_tag({"type": "dispatch", "rules": []}),
            f.structural_tag({"type": "sequence"}),
            f.structural_tag({"type": "tags_with_separator", "tags": [], "separator": ""}),
            f.structural_tag({"type": "tags_with_separator", "tags": ["x"], "separator": ""}),
            f.structural_tag({"type": "or", "elements": []}),
            f.structural_tag(f.arguments({"type": "object", "properties": {"a": {}}, "required": 5})),
            f.structural_tag(
                f.arguments(functools.reduce(lambda inner, _: {"type": "array", "items": inner}, range(5000), {}))
            ),
        ],
    )
    def test_malformed_or_unknown_formats_are_value_errors(self, tag):
        with pytest.raises(ValueError):
            structural_tag_to_gbnf(tag)
