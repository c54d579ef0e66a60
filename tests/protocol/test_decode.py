"""Strict decoding: literal bytes in, a typed request or a 400 naming the field out."""

import pytest

from deltafin.errors import InvalidRequestError
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.protocol.completions import CompletionRequest
from deltafin.protocol.decode import decode_request, public_schema_components


def error_of(raw: bytes, request_type=ChatCompletionRequest) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        decode_request(raw, request_type)
    return info.value


class TestDecodeRequest:
    @pytest.mark.parametrize(
        "raw,param", [(b'{"prompt": "x", "max_tokens": "2"}', "max_tokens"), (b'{"prompt": "x", "n": 1.0}', "n")]
    )
    def test_no_coercion(self, raw, param):
        assert error_of(raw, CompletionRequest).param == param

    def test_missing_nested_field_is_named_with_its_path(self):
        assert error_of(b'{"messages": [{"content": "x"}]}').param == "messages[0].role"

    def test_deep_nesting_is_a_400(self):
        assert (
            "nested too deeply"
            in error_of(b'{"chat_template_kwargs": {"a": ' + b"[" * 5000 + b"]" * 5000 + b"}}").message
        )

    def test_malformed_json(self):
        assert "not valid JSON" in error_of(b'{"messages": [').message

    def test_unknown_fields_are_tolerated(self):
        assert decode_request(b'{"prompt": "x", "some_sdk_extra": {"a": 1}}', CompletionRequest).prompt == "x"


def test_published_schemas_hold_the_request_fields():
    components = public_schema_components([CompletionRequest])
    assert {"prompt", "max_tokens", "echo"} <= set(components["CompletionRequest"]["properties"])
