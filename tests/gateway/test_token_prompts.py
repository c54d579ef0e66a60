"""/v1/completions prompts given as token ids: decoded by msgspec, checked against the vocabulary."""

from __future__ import annotations

import msgspec
import pytest

from deltafin.errors import InvalidRequestError
from deltafin.protocol.completions import CompletionRequest


def parse(body: dict) -> CompletionRequest:
    return msgspec.json.decode(msgspec.json.encode(body), type=CompletionRequest)


def test_string_prompt_has_no_ids():
    assert parse({"prompt": "hi"}).prompt_token_ids(100) is None


def test_id_prompt_is_returned_as_given():
    request = parse({"prompt": [5, 0, 99], "return_token_ids": True})
    assert request.prompt_token_ids(100) == [5, 0, 99] and request.return_token_ids


@pytest.mark.parametrize("prompt", [[100], [1, 2, 10**9]])
def test_ids_outside_the_vocabulary_are_400(prompt):
    with pytest.raises(InvalidRequestError) as caught:
        parse({"prompt": prompt}).prompt_token_ids(100)
    assert caught.value.status == 400 and caught.value.param == "prompt"


def test_empty_id_list_fails_to_decode():
    # The strict request type refuses it (a 400 naming `prompt` over HTTP, tests/app): nothing to generate from.
    with pytest.raises(msgspec.ValidationError, match=r"\$\.prompt"):
        parse({"prompt": []})


@pytest.mark.parametrize("prompt", [[-1], [1.5], 42, [[1, 2]]])
def test_other_shapes_fail_to_decode(prompt):
    with pytest.raises(msgspec.ValidationError):
        parse({"prompt": prompt})
