"""A choice whose upstream stream breaks before its first event is sent once more (behind a router, that is
another replica); once anything of it came, a failure is the client's error. Shown with the vLLM adapter: the
rule lives in the engine, every adapter shares it."""

from __future__ import annotations

import asyncio

from deltafin.engine import GenerationJob
from deltafin.engine.upstream.vllm import VllmAdapter
from deltafin.protocol.sampling import SamplingParams
from deltafin.testing.upstream_fakes import DROP, Fake, ScriptedBody, collect, make_front
from tests.gateway.test_vllm import generate_events, ids_of


def job(max_tokens=32):
    return GenerationJob((1, 2, 3), SamplingParams(max_tokens=max_tokens, temperature=0.0))


def answers(*bodies):
    """A fake answering its n-th request with the n-th body (the last one from then on)."""
    made = iter(bodies)
    last = []

    def respond(body, path):
        last[:] = [next(made, None) or last[0]]
        return last[0]()

    return Fake(respond)


def run(coro):
    return asyncio.run(coro)


def test_dropped_before_the_first_event_is_sent_again_and_answered_whole(bundle, capsys):
    ids = ids_of(bundle, "Hi there")
    fake = answers(lambda: ScriptedBody([DROP]), lambda: ScriptedBody(generate_events(ids, finish="length")))
    out = run(collect(make_front(VllmAdapter, bundle, fake, api="generate"), job(len(ids))))
    assert out.start_error is None and out.error is None and out.text == "Hi there"
    assert len(fake.requests) == 2 and fake.requests[0][1] == fake.requests[1][1]
    assert capsys.readouterr().out.count("upstream_resend") == 1


def test_a_stream_ended_empty_is_sent_again(bundle):
    ids = ids_of(bundle, "Hi")
    fake = answers(lambda: ScriptedBody([], tail=b""), lambda: ScriptedBody(generate_events(ids, finish="length")))
    out = run(collect(make_front(VllmAdapter, bundle, fake, api="generate"), job(len(ids))))
    assert out.text == "Hi" and len(fake.requests) == 2


def test_sent_twice_at_most_then_a_502_before_any_byte(bundle):
    fake = answers(lambda: ScriptedBody([DROP]))
    out = run(collect(make_front(VllmAdapter, bundle, fake, api="generate"), job()))
    assert out.start_error is not None and out.start_error.status == 502
    assert len(fake.requests) == 2


def test_never_sent_again_once_a_token_came(bundle):
    ids = ids_of(bundle, "Hi there")
    fake = answers(lambda: ScriptedBody(generate_events(ids, per_chunk=1)[:1] + [DROP]))
    out = run(collect(make_front(VllmAdapter, bundle, fake, api="generate"), job()))
    assert out.text and out.error is not None and out.error.status == 502
    assert len(fake.requests) == 1


def test_a_silent_upstream_is_not_sent_twice(bundle):
    """A read timeout may be an upstream still at work (a long prefill): a 504, one request."""
    fake = answers(lambda: ScriptedBody([{"choices": []}], delay=2.0))
    out = run(collect(make_front(VllmAdapter, bundle, fake, api="generate", read_timeout_s=0.3), job()))
    assert out.start_error is not None and out.start_error.status == 504
    assert len(fake.requests) == 1
