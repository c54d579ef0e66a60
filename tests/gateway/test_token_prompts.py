"""/v1/completions prompts: a string, token ids, or a batch of either; ids checked against the vocabulary."""

from __future__ import annotations

import msgspec
import pytest

from deltafin.errors import InvalidRequestError
from deltafin.protocol.completions import MAX_CHOICES, CompletionRequest


def parse(body: dict) -> CompletionRequest:
    return msgspec.json.decode(msgspec.json.encode(body), type=CompletionRequest)


def test_string_prompt_is_one_prompt():
    assert parse({"prompt": "hi"}).prompts(100) == ["hi"]


def test_id_prompt_is_returned_as_given():
    request = parse({"prompt": [5, 0, 99], "return_token_ids": True})
    assert request.prompts(100) == [[5, 0, 99]] and request.return_token_ids


def test_batches_of_strings_and_of_id_lists():
    assert parse({"prompt": ["a", "b"]}).prompts(100) == ["a", "b"]
    assert parse({"prompt": [[1, 2], [3]]}).prompts(100) == [[1, 2], [3]]


@pytest.mark.parametrize(
    "prompt,param",
    [
        ([100], "prompt"),
        ([1, 2, 10**9], "prompt"),
        ([[1], [100]], "prompt[1]"),
        ([[1], []], "prompt[1]"),
        (["a", ""], "prompt[1]"),
        ([[1, -1]], "prompt[0]"),
        ([[1.5]], "prompt[0]"),
        (["a", [1]], "prompt"),
        ([1, "a"], "prompt"),
        ([True], "prompt"),
    ],
)
def test_bad_prompts_are_400_naming_the_prompt(prompt, param):
    with pytest.raises(InvalidRequestError) as caught:
        parse({"prompt": prompt}).prompts(100)
    assert caught.value.status == 400 and caught.value.param == param


def test_prompts_times_n_is_bounded():
    with pytest.raises(InvalidRequestError):
        parse({"prompt": ["a"] * (MAX_CHOICES // 2 + 1), "n": 2}).prompts(100)


def test_empty_list_fails_to_decode():
    # The strict request type refuses it (a 400 naming `prompt` over HTTP, tests/app): nothing to generate from.
    with pytest.raises(msgspec.ValidationError, match=r"\$\.prompt"):
        parse({"prompt": []})


@pytest.mark.parametrize("prompt", [42, None, {"a": 1}])
def test_other_shapes_fail_to_decode(prompt):
    with pytest.raises(msgspec.ValidationError):
        parse({"prompt": prompt})
