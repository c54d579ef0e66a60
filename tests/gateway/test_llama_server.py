"""llama-server adapter against a fake /completion: explicit sampling knobs, tokens back, stop ids it lacks."""

from __future__ import annotations

import asyncio

import pytest

from deltafin.engine import GenerationJob
from deltafin.engine.upstream.engine import UpstreamSettings
from deltafin.engine.upstream.llama_server import LlamaServerAdapter
from deltafin.errors import ContextLengthError
from deltafin.protocol.sampling import SamplingParams
from deltafin.testing.upstream_fakes import Fake, ScriptedBody, collect, make_front


def job(max_tokens=64, **params):
    return GenerationJob((1, 2), SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))


def events(ids, *, stop_type="limit", cache_n=1, probs=False):
    out = []
    for i in ids:
        event = {"content": "x", "tokens": [i], "stop": False}
        if probs:
            event["completion_probabilities"] = [
                {
                    "id": i,
                    "token": "x",
                    "logprob": -1.0,
                    "top_logprobs": [{"id": i, "logprob": -1.0}, {"id": 0, "logprob": -3.0}],
                }
            ]
        out.append(event)
    out.append(
        {
            "content": "",
            "tokens": [],
            "stop": True,
            "stop_type": stop_type,
            "tokens_predicted": len(ids),
            "tokens_evaluated": 2,
            "timings": {"cache_n": cache_n, "prompt_n": 1},
        }
    )
    return out


def test_every_sampling_knob_is_sent(bundle):
    ids = bundle.tokenizer("Hi there", add_special_tokens=False).input_ids
    fake = Fake(lambda b, p: ScriptedBody(events(ids)))
    out = asyncio.run(collect(make_front(LlamaServerAdapter, bundle, fake), job(max_tokens=len(ids))))
    assert out.text == "Hi there" and out.finished.reason == "length" and out.finished.cached_tokens == 1
    path, body = fake.requests[0]
    assert path == "/completion" and body["prompt"] == [1, 2] and body["return_tokens"] is True
    # llama.cpp's own defaults would change the tokens: each one is neutralised or set.
    assert body["samplers"] == ["penalties", "top_k", "top_p", "min_p", "temperature"]
    assert body["dry_multiplier"] == 0.0 and body["xtc_probability"] == 0.0 and body["typical_p"] == 1.0
    # Greedy: top-k 1, the same token as temperature 0 without a softmax of the vocabulary per step.
    assert body["top_k"] == 1 and body["repeat_last_n"] == 2 + len(ids) and body["temperature"] == 0.0
    assert "stop" not in body


@pytest.mark.parametrize("top_k,sent", [(0, 0), (5, 5)])
def test_sampled_requests_send_their_own_top_k(top_k, sent):
    settings = UpstreamSettings(url="http://upstream")
    params = SamplingParams(max_tokens=4, temperature=0.7, top_k=top_k)
    _, body = LlamaServerAdapter(settings).request(GenerationJob((1, 2), params), "rid", frozenset())
    assert body["top_k"] == sent and body["temperature"] == 0.7


def test_eos_stop_type_is_stop(bundle):
    ids = bundle.tokenizer("Hi", add_special_tokens=False).input_ids
    fake = Fake(lambda b, p: ScriptedBody(events(ids, stop_type="eos")))
    out = asyncio.run(collect(make_front(LlamaServerAdapter, bundle, fake), job()))
    assert out.finished.reason == "stop" and out.text == "Hi"


def test_a_stop_id_llama_server_does_not_know_ends_the_request(bundle):
    # llama-server has no stop_token_ids: Deltafin stops on the request's own stop id and closes the stream.
    ids = bundle.tokenizer("Hi there friend", add_special_tokens=False).input_ids
    fake = Fake(lambda b, p: ScriptedBody(events(ids), delay=0.01))
    out = asyncio.run(collect(make_front(LlamaServerAdapter, bundle, fake), job(stop_token_ids=(ids[1],))))
    assert out.finished.reason == "stop" and out.finished.stop_reason == ids[1]
    assert out.text == bundle.tokenizer.decode(ids[:1]) and fake.bodies[0].closed_early


def test_n_probs_map_to_logprobs_with_the_asked_alternatives(bundle):
    ids = bundle.tokenizer("Hi", add_special_tokens=False).input_ids
    fake = Fake(lambda b, p: ScriptedBody(events(ids, probs=True)))
    out = asyncio.run(collect(make_front(LlamaServerAdapter, bundle, fake), job(logprobs=True, top_logprobs=1)))
    assert [lp.token_id for lp in out.logprobs] == ids and out.logprobs[0].top == ((ids[0], -1.0),)
    assert fake.requests[0][1]["n_probs"] == 1


def test_context_overflow_is_400(bundle):
    body = {
        "error": {
            "code": 400,
            "message": "the request exceeds the available context size, try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 9000,
            "n_ctx": 4096,
        }
    }
    fake = Fake(lambda b, p: (400, body))
    out = asyncio.run(collect(make_front(LlamaServerAdapter, bundle, fake), job()))
    assert isinstance(out.start_error, ContextLengthError) and out.start_error.code == "context_length_exceeded"
