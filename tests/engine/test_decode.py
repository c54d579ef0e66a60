"""ChoiceDecoder: ids -> TextDelta / Finished, the same for every engine."""

from __future__ import annotations

import pytest

from deltafin.engine.text.choice_decoder import ChoiceDecoder
from deltafin.engine.weights.tokenizer_only import load_tokenizer_only
from deltafin.protocol.sampling import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(config):
    return load_tokenizer_only(config.model).tokenizer


def run(tokenizer, ids, **params):
    decoder = ChoiceDecoder(tokenizer, SamplingParams(max_tokens=100, **params), frozenset({2}))
    deltas = [decoder.push(i) for i in ids]
    tail, finished = decoder.finish("length", prompt_tokens=5)
    text = "".join(d.text for d in deltas if d is not None) + (tail.text if tail else "")
    return text, finished, deltas


def test_text_is_the_whole_decoding(tokenizer):
    ids = tokenizer("naïve café 🙂 done", add_special_tokens=False).input_ids
    text, finished, _ = run(tokenizer, ids)
    assert text == "naïve café 🙂 done" and finished.reason == "length" and finished.completion_tokens == len(ids)


def test_stop_id_counts_but_is_not_text_and_later_ids_are_ignored(tokenizer):
    ids = tokenizer("Hi", add_special_tokens=False).input_ids
    text, finished, deltas = run(tokenizer, ids + [2, 42, 43])
    assert text == "Hi" and finished.reason == "stop" and finished.stop_reason == 2
    assert finished.completion_tokens == len(ids) + 1 and deltas[-1] is None


def test_stop_string_cuts_and_held_text_is_released_at_the_end(tokenizer):
    ids = tokenizer("Hello world", add_special_tokens=False).input_ids
    assert run(tokenizer, ids, stop=("world",))[0] == "Hello "
    text, finished, _ = run(tokenizer, ids, stop=("worldwide",))
    assert text == "Hello world" and finished.reason == "length"


def test_ignore_eos_keeps_going_past_the_eos(tokenizer):
    text, finished, _ = run(tokenizer, [2] + tokenizer("Hi", add_special_tokens=False).input_ids, ignore_eos=True)
    assert text.endswith("Hi") and finished.reason == "length"
