"""XGrammarRow on the real default model and tokenizer (grammars compiled in this thread)."""

from __future__ import annotations

import json

import pydantic
import pytest
import torch

from deltafin.grammar.constraints import json_object, json_schema
from deltafin.prompt import build_chat_format
from deltafin.protocol.chat import ChatMessage
from tests.grammar.decoding import greedy, row_factory


class Person(pydantic.BaseModel):
    name: str
    age: int
    languages: list[str] = pydantic.Field(max_length=3)


@pytest.fixture(scope="module")
def factory(loaded_model):
    return row_factory(loaded_model.tokenizer, loaded_model.model.config.vocab_size, loaded_model.stop_token_ids)


def render(config, loaded_model, question: str) -> list[int]:
    fmt = build_chat_format(
        config.model.chat_format, loaded_model.tokenizer, content_format=config.model.content_format, default_kwargs={}
    )
    return fmt.render([ChatMessage(role="user", content=question)], None, {}).token_ids


@pytest.fixture(scope="module")
def prompt(config, loaded_model):
    return render(config, loaded_model, "Describe a programmer called Ada in JSON.")


def decode(loaded_model, prompt, row, max_tokens=96) -> str:
    ids = greedy(loaded_model.model, prompt, row, max_tokens=max_tokens, stop_ids=loaded_model.stop_token_ids)
    return loaded_model.tokenizer.decode([i for i in ids if i not in loaded_model.stop_token_ids])


class TestMaskedDecoding:
    def test_schema_constrained_greedy_output_validates(self, loaded_model, prompt, factory):
        row = factory(json_schema(Person.model_json_schema()))
        text = decode(loaded_model, prompt, row)
        person = Person.model_validate_json(text)  # raises unless the text is valid JSON of that shape
        assert row.is_terminated() and isinstance(person.age, int)
        assert list(json.loads(text)) == ["name", "age", "languages"]  # the schema's property order

    def test_json_object_gives_an_object(self, config, loaded_model, factory):
        ids = render(config, loaded_model, "What is the capital of France? Answer in JSON.")
        text = decode(loaded_model, ids, factory(json_object()), max_tokens=48)
        assert isinstance(json.loads(text), dict)


class TestMask:
    def test_disallowed_tokens_become_minus_inf_and_allowed_keep_their_logit(self, loaded_model, factory):
        row = factory(json_object())
        logits = torch.randn(loaded_model.model.config.vocab_size)
        before = logits.clone()
        row.fill_mask(logits)
        brace = loaded_model.tokenizer.convert_tokens_to_ids("{")
        letter = loaded_model.tokenizer.convert_tokens_to_ids("a")
        assert logits[brace] == before[brace]  # an object must start with "{" (after optional whitespace)
        assert logits[letter] == float("-inf")

    def test_after_the_object_only_stop_tokens_remain(self, loaded_model, factory):
        row = factory(json_object())
        for token in loaded_model.tokenizer("{}", add_special_tokens=False).input_ids:
            row.accept(token)
        logits = torch.zeros(loaded_model.model.config.vocab_size)
        row.fill_mask(logits)
        allowed = set(torch.nonzero(logits == 0).flatten().tolist())
        assert allowed == set(loaded_model.stop_token_ids)
        assert not row.is_terminated()
        row.accept(next(iter(loaded_model.stop_token_ids)))
        assert row.is_terminated()

    def test_a_token_outside_the_grammar_terminates_the_row(self, loaded_model, factory):
        row = factory(json_object())
        row.accept(loaded_model.tokenizer.convert_tokens_to_ids("a"))
        assert row.is_terminated()
        logits = torch.zeros(loaded_model.model.config.vocab_size)
        row.fill_mask(logits)  # a terminated row leaves the logits alone rather than masking everything
        assert torch.all(logits == 0)
