"""OpenAI fields -> SamplingParams: defaults only where a field is None; explicit zeros are values."""

import msgspec
import pytest

from deltafin.errors import InvalidRequestError
from deltafin.protocol.chat import ChatCompletionRequest


def request(**fields) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "x"}], **fields}, ChatCompletionRequest)


def params(req, **kw):
    return req.sampling_params(
        max_tokens=kw.pop("max_tokens", 10), vocab_size=100, logprobs=False, top_logprobs=0, **kw
    )


class TestSamplingMapping:
    def test_defaults_when_omitted(self):
        p = params(request())
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)

    def test_explicit_zero_temperature_is_kept(self):
        assert params(request(temperature=0)).greedy

    def test_explicit_zero_penalties_are_kept(self):
        p = params(request(presence_penalty=0, frequency_penalty=0))
        assert p.presence_penalty == 0.0 and p.frequency_penalty == 0.0

    def test_max_completion_tokens_wins(self):
        assert request(max_tokens=5, max_completion_tokens=7).requested_max_tokens() == 7
        assert request(max_tokens=5).requested_max_tokens() == 5
        assert request().requested_max_tokens() is None

    def test_seed_differs_per_choice(self):
        req = request(seed=10, n=2)
        assert params(req, choice=0).seed == 10 and params(req, choice=1).seed == 11

    def test_stop_string_or_list(self):
        assert params(request(stop="END")).stop == ("END",)
        assert params(request(stop=["a", "b"])).stop == ("a", "b")

    def test_logit_bias_keys_must_be_token_ids(self):
        with pytest.raises(InvalidRequestError, match="logit_bias"):
            params(request(logit_bias={"abc": 1}))
        with pytest.raises(InvalidRequestError, match="outside"):
            params(request(logit_bias={"1000": 1}))

    def test_top_logprobs_needs_logprobs(self):
        with pytest.raises(InvalidRequestError) as info:
            request(top_logprobs=2).check(max_n=4, max_stop=4, max_top_logprobs=20)
        assert info.value.param == "top_logprobs"

    def test_n_over_the_server_cap(self):
        with pytest.raises(InvalidRequestError) as info:
            request(n=9).check(max_n=8, max_stop=4, max_top_logprobs=20)
        assert info.value.param == "n"

    @pytest.mark.parametrize("field,value", [("temperature", 3), ("top_p", 0), ("n", 0), ("max_tokens", 0)])
    def test_out_of_range_values_fail_on_decode(self, field, value):
        with pytest.raises(msgspec.ValidationError, match=field):
            request(**{field: value})
