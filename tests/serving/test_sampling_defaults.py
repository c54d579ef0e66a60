"""A model's default sampling (deltafin.serving.sampling_defaults): read from generation_config.json and from
model.sampling, applied to what a request leaves out on every API; the request wins over them, and the compat
rules that pin or bound a field win over both."""

from __future__ import annotations

import json

import pytest
from litestar.testing import TestClient

from deltafin.app import build_app
from deltafin.app.services import Services
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.protocol.completions import CompletionRequest
from deltafin.protocol.sampling import NO_DEFAULTS, SamplingDefaults
from deltafin.serving.sampling_defaults import checkpoint_sampling, sampling_defaults_for, with_sampling_defaults
from tests.conftest import compose_config, make_engine

USER = [{"role": "user", "content": "Say hello."}]


def model_config(overrides: list[str]):
    return compose_config(overrides).model


class TestCheckpointValues:
    def test_the_keys_vllm_reads_and_max_new_tokens(self, tmp_path):
        (tmp_path / "generation_config.json").write_text(
            json.dumps(
                {
                    "do_sample": True,
                    "temperature": 0.6,
                    "top_p": 0.95,
                    "top_k": 20,
                    "min_p": 0,
                    "repetition_penalty": 1.05,
                    "max_new_tokens": 512,
                    "eos_token_id": [1, 2],
                }
            )
        )
        assert checkpoint_sampling(tmp_path) == {
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 20,
            "min_p": 0.0,
            "repetition_penalty": 1.05,
            "max_tokens": 512,
        }

    def test_values_of_the_wrong_type_or_range_are_left_out(self, tmp_path):
        (tmp_path / "generation_config.json").write_text(
            json.dumps(
                {
                    "temperature": "hot",
                    "top_p": 0,
                    "top_k": 2.5,
                    "min_p": 7,
                    "repetition_penalty": float("nan"),
                    "max_new_tokens": True,
                }
            )
        )
        assert checkpoint_sampling(tmp_path) == {}

    @pytest.mark.parametrize("text", ["", "[1, 2]", "{not json", "\xff\xfe"])
    def test_an_unreadable_file_gives_none(self, tmp_path, text):
        (tmp_path / "generation_config.json").write_text(text, encoding="latin-1")
        assert checkpoint_sampling(tmp_path) == {}

    def test_no_file_gives_none(self, tmp_path):
        assert checkpoint_sampling(tmp_path) == {}


class TestSources:
    @pytest.fixture
    def folder(self, tmp_path):
        (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20}))
        return tmp_path

    def test_checkpoint_values_win_and_the_yaml_fills_the_rest(self, folder):
        model = model_config(["model.sampling.temperature=0.3", "model.sampling.min_p=0.05"])
        defaults = sampling_defaults_for(model, folder)
        assert defaults.values() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05}
        assert dict(defaults.sources)["temperature"] == "generation_config.json"
        assert dict(defaults.sources)["min_p"] == "model.sampling"

    def test_config_reads_the_yaml_only(self, folder):
        model = model_config(["model.sampling_source=config"])
        assert sampling_defaults_for(model, folder).values() == {"temperature": 0.2, "top_p": 0.9}

    def test_none_applies_nothing(self, folder):
        assert sampling_defaults_for(model_config(["model.sampling_source=none"]), folder) is NO_DEFAULTS

    def test_the_default_model_gets_its_model_card_values(self):
        """SmolLM2-135M-Instruct's card samples at temperature 0.2, top_p 0.9; its GGUF has no generation config."""
        assert sampling_defaults_for(model_config([]), None).values() == {"temperature": 0.2, "top_p": 0.9}


class TestFilling:
    DEFAULTS = SamplingDefaults(temperature=0.2, top_p=0.9, top_k=40, min_p=0.05, max_tokens=64)

    def test_omitted_fields_are_filled(self):
        request = with_sampling_defaults(ChatCompletionRequest(messages=USER), self.DEFAULTS)
        assert (request.temperature, request.top_p, request.top_k, request.min_p) == (0.2, 0.9, 40, 0.05)
        assert request.max_tokens is None  # the default max tokens is the plan's (TestEveryApi, TestRules)

    def test_the_request_wins_an_explicit_zero_included(self):
        sent = ChatCompletionRequest(messages=USER, temperature=0.0, top_k=0, max_tokens=5)
        request = with_sampling_defaults(sent, self.DEFAULTS)
        assert (request.temperature, request.top_k, request.top_p) == (0.0, 0, 0.9)
        assert request.max_tokens == 5

    def test_completions_too(self):
        request = with_sampling_defaults(CompletionRequest(prompt="Hi"), self.DEFAULTS)
        assert (request.temperature, request.min_p, request.max_tokens) == (0.2, 0.05, None)

    def test_no_defaults_leave_the_request_itself(self):
        sent = ChatCompletionRequest(messages=USER)
        assert with_sampling_defaults(sent, NO_DEFAULTS) is sent


def serve(loaded_model, overrides: list[str]):
    """An in-process app over the real default model with `overrides`; the jobs it starts are recorded."""
    config = compose_config(overrides)
    services = Services.from_engine(config, make_engine(loaded_model, memo_entries=0))
    jobs: list = []
    engine = services.ctx.engine
    start = engine.start

    async def recording_start(submitted, **kwargs):
        jobs.extend(submitted)
        return await start(submitted, **kwargs)

    engine.start = recording_start  # type: ignore[method-assign]
    return TestClient(build_app(config, services)), jobs


@pytest.fixture(scope="module")
def served(loaded_model):
    client, jobs = serve(loaded_model, ["model.sampling.min_p=0.05", "model.sampling.max_tokens=3"])
    with client:
        yield client, jobs


class TestEveryApi:
    """The default model (model card values: temperature 0.2, top_p 0.9) through the real app and engine."""

    def test_chat_without_sampling_fields(self, served):
        client, jobs = served
        jobs.clear()
        body = client.post("/v1/chat/completions", json={"messages": USER}).json()
        params = jobs[0].params
        assert (params.temperature, params.top_p, params.min_p, params.max_tokens) == (0.2, 0.9, 0.05, 3)
        assert body["usage"]["completion_tokens"] <= 3

    def test_chat_fields_given_win(self, served):
        client, jobs = served
        jobs.clear()
        client.post(
            "/v1/chat/completions", json={"messages": USER, "temperature": 0, "top_p": 0.5, "min_p": 0, "max_tokens": 5}
        )
        params = jobs[0].params
        assert (params.temperature, params.top_p, params.min_p, params.max_tokens) == (0.0, 0.5, 0.0, 5)

    def test_max_completion_tokens_counts_as_asking(self, served):
        client, jobs = served
        jobs.clear()
        client.post("/v1/chat/completions", json={"messages": USER, "max_completion_tokens": 5})
        assert jobs[0].params.max_tokens == 5

    def test_completions(self, served):
        client, jobs = served
        jobs.clear()
        client.post("/v1/completions", json={"prompt": "Once upon a time", "top_k": 7})
        params = jobs[0].params
        assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.2, 0.9, 7, 3)

    def test_responses_take_top_k_and_min_p_and_echo_what_applied(self, served):
        client, jobs = served
        jobs.clear()
        body = client.post("/v1/responses", json={"input": "Say hello.", "top_k": 5, "min_p": 0.1}).json()
        params = jobs[0].params
        assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.2, 0.9, 5, 0.1)
        assert (body["temperature"], body["top_p"]) == (0.2, 0.9)

    def test_models_show_the_defaults(self, served):
        client, _ = served
        (card, alias) = client.get("/v1/models").json()["data"]
        expected = {"temperature": 0.2, "top_p": 0.9, "min_p": 0.05, "max_tokens": 3}
        assert card["sampling_defaults"] == alias["sampling_defaults"] == expected
        assert client.get("/v1/models/smollm2").json()["sampling_defaults"] == expected


class TestRules:
    def test_a_pin_wins_over_the_default_and_the_request(self, loaded_model):
        pins = "+compat.rules.pins={_target_: deltafin.rules.sampling_pins.SamplingPins, top_p: 0.5}"
        client, jobs = serve(loaded_model, [pins])
        with client:
            for sent in ({}, {"top_p": 0.7}):
                jobs.clear()
                response = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, **sent})
                assert jobs[0].params.top_p == 0.5 and jobs[0].params.temperature == 0.2
                assert "pins" in response.headers["x-deltafin-rules"]

    def test_a_rule_default_and_a_cap_bound_the_model_default(self, loaded_model):
        rules = [
            "model.sampling.max_tokens=9",
            "+compat.rules.cap={_target_: deltafin.rules.max_tokens_cap.MaxTokensCap, value: 4}",
        ]
        client, jobs = serve(loaded_model, rules)
        with client:
            client.post("/v1/chat/completions", json={"messages": USER})
            assert jobs[0].params.max_tokens == 4  # the cap bounds the model's default as it bounds the request
        chat_default = (
            "+compat.rules.d={_target_: deltafin.rules.chat_default_max_tokens.ChatDefaultMaxTokens, value: 2}"
        )
        client, jobs = serve(loaded_model, ["model.sampling.max_tokens=9", chat_default])
        with client:
            client.post("/v1/chat/completions", json={"messages": USER})
            assert jobs[0].params.max_tokens == 2  # the rule's default wins over the model's


class TestCheckpointServed:
    def test_a_checkpoint_folder_serves_its_generation_config(self, tmp_path):
        from deltafin.engine.weights.loader import load_model
        from deltafin.testing import TINY_OVERRIDES
        from deltafin.tiny import write_tiny_model

        folder = write_tiny_model("qwen3", tmp_path / "tiny")
        generation = json.loads((folder / "generation_config.json").read_text())
        generation.update(temperature=0.6, top_k=20, max_new_tokens=4)
        (folder / "generation_config.json").write_text(json.dumps(generation))
        overrides = [*TINY_OVERRIDES["qwen3"], f"model.path={folder}", "model.sampling.top_p=0.8"]
        config = compose_config(overrides)
        client, jobs = serve(load_model(config.model, config.placement), overrides)
        with client:
            client.post("/v1/chat/completions", json={"messages": USER})
            params = jobs[0].params
            assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.6, 20, 0.8, 4)
            card = client.get("/v1/models").json()["data"][0]
            assert card["sampling_defaults"] == {"temperature": 0.6, "top_p": 0.8, "top_k": 20, "max_tokens": 4}
