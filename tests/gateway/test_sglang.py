"""SGLang adapter against a fake /generate: cumulative and incremental streams, errors inside a 200, abort."""

from __future__ import annotations

import asyncio

import pytest

from deltafin.engine import GenerationJob
from deltafin.engine.upstream.sglang import SglangAdapter
from deltafin.errors import ContextLengthError, UpstreamError
from deltafin.protocol.sampling import SamplingParams
from deltafin.testing.upstream_fakes import Fake, ScriptedBody, collect, make_front

TEXT = "Hello there, world! How are you?"


def job(max_tokens=64, **params):
    return GenerationJob((5, 6, 7, 8), SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))


def events(ids, *, cumulative=True, finish=None, cached=3, logprobs=False):
    """One event per id, as SGLang streams them; the last carries `finish`."""
    out = []
    for n in range(1, len(ids) + 1):
        shown = ids[:n] if cumulative else ids[n - 1 : n]
        meta = {
            "id": "r",
            "prompt_tokens": 4,
            "completion_tokens": n,
            "cached_tokens": cached,
            "finish_reason": finish if n == len(ids) else None,
        }
        if logprobs:
            entries = [[-0.25, i, None] for i in shown]
            meta["output_token_logprobs"] = entries
            meta["output_top_logprobs"] = [[[-0.25, i, None]] for i in shown]
        out.append({"text": "ignored", "output_ids": shown, "meta_info": meta})
    return out


@pytest.mark.parametrize("cumulative", [True, False])
def test_cumulative_and_incremental_streams_give_the_same_text(bundle, cumulative):
    ids = bundle.tokenizer(TEXT, add_special_tokens=False).input_ids
    fake = Fake(
        lambda b, p: ScriptedBody(events(ids, cumulative=cumulative, finish={"type": "length", "length": len(ids)}))
    )
    out = asyncio.run(collect(make_front(SglangAdapter, bundle, fake), job(max_tokens=len(ids))))
    assert out.text == TEXT and out.ids == ids
    assert out.finished.reason == "length" and out.finished.cached_tokens == 3 and out.finished.prompt_tokens == 4


def test_request_sends_input_ids_and_never_trims(bundle):
    ids = bundle.tokenizer("Hi", add_special_tokens=False).input_ids + [2]
    fake = Fake(lambda b, p: ScriptedBody(events(ids, finish={"type": "stop", "matched": 2})))
    out = asyncio.run(collect(make_front(SglangAdapter, bundle, fake), job(seed=9, logprobs=True, top_logprobs=1)))
    assert out.text == "Hi" and out.finished.reason == "stop" and out.finished.stop_reason == 2
    path, body = fake.requests[0]
    assert path == "/generate" and body["input_ids"] == [5, 6, 7, 8] and body["rid"]
    knobs = body["sampling_params"]
    assert knobs["skip_special_tokens"] is False and knobs["no_stop_trim"] is True and "stop" not in knobs
    assert knobs["sampling_seed"] == 9 and knobs["max_new_tokens"] == 64
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 1


def test_cumulative_logprobs_are_not_repeated(bundle):
    ids = bundle.tokenizer("Hi there", add_special_tokens=False).input_ids
    fake = Fake(lambda b, p: ScriptedBody(events(ids, finish={"type": "length"}, logprobs=True)))
    out = asyncio.run(collect(make_front(SglangAdapter, bundle, fake), job(logprobs=True, top_logprobs=1)))
    assert [lp.token_id for lp in out.logprobs] == ids and all(lp.logprob == -0.25 for lp in out.logprobs)


def test_error_inside_a_200_before_any_token_is_a_real_status(bundle):
    fake = Fake(
        lambda b, p: ScriptedBody(
            [{"error": {"message": "The input (5000 tokens) is longer than the model's context length (4096 tokens)."}}]
        )
    )
    out = asyncio.run(collect(make_front(SglangAdapter, bundle, fake), job()))
    assert isinstance(out.start_error, ContextLengthError) and out.start_error.status == 400


def test_abort_finish_mid_stream_is_an_in_stream_error(bundle):
    ids = bundle.tokenizer("Hi there", add_special_tokens=False).input_ids
    stream = events(ids)[:1] + [
        {
            "text": "",
            "output_ids": ids[:1],
            "meta_info": {"completion_tokens": 1, "finish_reason": {"type": "abort", "message": "scheduler OOM"}},
        }
    ]
    fake = Fake(lambda b, p: ScriptedBody(stream))
    out = asyncio.run(collect(make_front(SglangAdapter, bundle, fake), job()))
    assert out.start_error is None and isinstance(out.error, UpstreamError) and "scheduler OOM" in out.error.message


def test_client_leaving_calls_abort_request_with_the_rid(bundle):
    ids = bundle.tokenizer(TEXT * 3, add_special_tokens=False).input_ids

    def respond(body, path):
        if path == "/abort_request":
            return 200, {}
        return ScriptedBody(events(ids, finish={"type": "length"}), delay=0.02)

    fake = Fake(respond)
    front = make_front(SglangAdapter, bundle, fake)
    asyncio.run(collect(front, job(max_tokens=len(ids)), stop_after=2))
    rid = fake.requests[0][1]["rid"]
    assert ("/abort_request", {"rid": rid}) in fake.requests
    assert fake.bodies[0].closed_early and front.admission.in_use == 0
