"""Constrained decoding travels to each upstream in that engine's own field (a 400 where it cannot)."""

from __future__ import annotations

import json

import pytest

from deltafin.engine import GenerationJob
from deltafin.engine.upstream.engine import UpstreamSettings
from deltafin.engine.upstream.llama_server import LlamaServerAdapter, added_tokens
from deltafin.engine.upstream.sglang import SglangAdapter
from deltafin.engine.upstream.vllm import VllmAdapter
from deltafin.errors import InvalidRequestError
from deltafin.protocol.sampling import Constraint, SamplingParams

SCHEMA = '{"properties": {"city": {"type": "string"}}, "type": "object"}'
TAG = '{"format": {"type": "const_string", "value": "x"}, "type": "structural_tag"}'
SETTINGS = UpstreamSettings(url="http://127.0.0.1:1")


def body(adapter, constraint):
    job = GenerationJob((1, 2), SamplingParams(max_tokens=4, temperature=0.0, constraint=constraint))
    return adapter.request(job, "rid-1", frozenset({0}))[1]


class TestVllm:
    @pytest.mark.parametrize("api", ["auto", "completions"])
    def test_each_kind_goes_in_structured_outputs(self, api):
        adapter = VllmAdapter(SETTINGS, api=api)

        def knobs(constraint):
            sent = body(adapter, constraint)
            return (sent.get("sampling_params", sent))["structured_outputs"]

        assert knobs(Constraint("json_schema", SCHEMA)) == {"json": json.loads(SCHEMA)}
        assert knobs(Constraint("json_object")) == {"json_object": True}
        assert knobs(Constraint("structural_tag", TAG)) == {"structural_tag": TAG}

    def test_no_constraint_sends_none(self):
        assert "structured_outputs" in json.dumps(body(VllmAdapter(SETTINGS), Constraint("json_object")))
        assert "structured_outputs" not in json.dumps(body(VllmAdapter(SETTINGS), None))


class TestSglang:
    def test_each_kind_goes_in_sampling_params(self):
        adapter = SglangAdapter(SETTINGS)
        assert body(adapter, Constraint("json_schema", SCHEMA))["sampling_params"]["json_schema"] == SCHEMA
        assert json.loads(body(adapter, Constraint("json_object"))["sampling_params"]["json_schema"]) == {
            "type": "object"
        }
        assert body(adapter, Constraint("structural_tag", TAG))["sampling_params"]["structural_tag"] == TAG


class TestLlamaServer:
    def test_json_constraints_go_in_json_schema(self):
        adapter = LlamaServerAdapter(SETTINGS)
        assert body(adapter, Constraint("json_schema", SCHEMA))["json_schema"] == json.loads(SCHEMA)
        assert body(adapter, Constraint("json_object"))["json_schema"] == {"type": "object"}

    def test_a_structural_tag_goes_in_grammar_as_gbnf(self):
        sent = body(LlamaServerAdapter(SETTINGS), Constraint("structural_tag", TAG))
        assert sent["grammar"] == 'root ::= "x"\n' and "json_schema" not in sent

    def test_added_tokens_are_written_as_token_ids(self):
        tag = '{"format": {"type": "const_string", "value": "<|open|>tools<|sep|>"}, "type": "structural_tag"}'
        adapter = LlamaServerAdapter(SETTINGS, {"<|open|>": 7, "<|sep|>": 9})
        assert body(adapter, Constraint("structural_tag", tag))["grammar"] == 'root ::= <[7]> "tools" <[9]>\n'

    def test_added_tokens_leave_out_stop_tokens_single_characters_and_whitespace(self):
        class Tokenizer:
            def get_added_vocab(self):
                return {"<|open|>": 7, "<|im_end|>": 2, "\n\n": 11, "x": 12, "<tool_call>": 13}

        assert added_tokens(Tokenizer(), frozenset({2})) == {"<|open|>": 7, "<tool_call>": 13}

    @pytest.mark.parametrize(
        ("fmt", "param"),
        [
            (
                '{"type": "tags_with_separator", "tags": [{"type": "tag", "begin": "<a>", "end": "</a>", "content": '
                '{"type": "json_schema", "json_schema": {"type": "object", "not": {}}}}], "separator": ""}',
                "tools",
            ),
            ('{"type": "regex", "pattern": "(?=x)x"}', "response_format"),
        ],
    )
    def test_a_tag_without_gbnf_form_is_a_400_naming_the_field(self, fmt, param):
        tag = f'{{"format": {fmt}, "type": "structural_tag"}}'
        with pytest.raises(InvalidRequestError) as info:
            body(LlamaServerAdapter(SETTINGS), Constraint("structural_tag", tag))
        assert info.value.status == 400 and info.value.param == param and "llama-server" in str(info.value)
