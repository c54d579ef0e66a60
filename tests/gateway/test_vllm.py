"""vLLM adapter against a fake speaking /inference/v1/generate and /v1/completions (token ids in and out)."""

from __future__ import annotations

import asyncio

import pytest

from deltafin.engine import GenerationJob
from deltafin.engine.upstream.vllm import COMPLETIONS, GENERATE, VllmAdapter
from deltafin.errors import ContextLengthError, UpstreamBusyError, UpstreamError, UpstreamUnavailableError
from deltafin.protocol.sampling import SamplingParams
from deltafin.testing.upstream_fakes import DROP, Fake, ScriptedBody, collect, make_front

TEXT = "Hello there, world! How are you?"


def ids_of(bundle, text=TEXT):
    return bundle.tokenizer(text, add_special_tokens=False).input_ids


def job(max_tokens=32, **params):
    return GenerationJob((1, 2, 3), SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))


def generate_events(ids, *, finish="stop", per_chunk=2, logprobs=False):
    events = []
    for start in range(0, len(ids), per_chunk):
        part = ids[start : start + per_chunk]
        lp = {
            "content": [
                {
                    "token": f"token_id:{i}",
                    "logprob": -0.5,
                    "top_logprobs": [{"token": f"token_id:{i}", "logprob": -0.5}],
                }
                for i in part
            ]
        }
        last = start + per_chunk >= len(ids)
        events.append(
            {
                "choices": [
                    {
                        "index": 0,
                        "token_ids": part,
                        "logprobs": lp if logprobs else None,
                        "finish_reason": finish if last else None,
                    }
                ]
            }
        )
    return events


def completion_events(ids, *, finish="length", cached=7):
    events = [
        {"choices": [{"index": 0, "text": "x", "token_ids": [i], "logprobs": None, "finish_reason": None}]} for i in ids
    ]
    events.append({"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": finish}]})
    events.append(
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 3,
                "completion_tokens": len(ids),
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
    )
    return events


def run(coro):
    return asyncio.run(coro)


class TestGenerateEndpoint:
    def test_text_is_deltafins_own_decoding_of_the_ids(self, bundle):
        ids = ids_of(bundle)
        fake = Fake(lambda body, path: ScriptedBody(generate_events(ids, finish="length")))
        out = run(collect(make_front(VllmAdapter, bundle, fake), job(max_tokens=len(ids))))
        assert out.text == TEXT and out.ids == ids
        assert out.finished.reason == "length" and out.finished.completion_tokens == len(ids)
        path, body = fake.requests[0]
        assert path == GENERATE and body["token_ids"] == [1, 2, 3] and body["stream"] is True
        knobs = body["sampling_params"]
        assert knobs["skip_special_tokens"] is False and "stop" not in knobs and knobs["temperature"] == 0.0
        assert set(bundle.stop_token_ids) <= set(knobs["stop_token_ids"])

    def test_ignore_eos_sends_no_stop_ids(self, bundle):
        """vLLM's `ignore_eos` does not override an EOS named in `stop_token_ids`: the gateway names none, so the
        choice runs to max_tokens as on the local engine."""
        ids = ids_of(bundle, "Hi") + [2, 2]
        fake = Fake(lambda body, path: ScriptedBody(generate_events(ids, per_chunk=1, finish="length")))
        out = run(collect(make_front(VllmAdapter, bundle, fake), job(max_tokens=len(ids), ignore_eos=True)))
        assert fake.requests[0][1]["sampling_params"]["stop_token_ids"] == []
        assert out.ids == ids and out.finished.reason == "length"

    def test_stop_token_ends_the_choice_without_text(self, bundle):
        ids = ids_of(bundle, "Hi") + [2]  # 2 is SmolLM2's EOS
        fake = Fake(lambda body, path: ScriptedBody(generate_events(ids, per_chunk=1)))
        out = run(collect(make_front(VllmAdapter, bundle, fake), job()))
        assert out.text == "Hi" and out.finished.reason == "stop" and out.finished.stop_reason == 2

    def test_stop_string_is_matched_by_deltafin_and_closes_the_upstream(self, bundle):
        ids = ids_of(bundle)
        fake = Fake(lambda body, path: ScriptedBody(generate_events(ids, per_chunk=1, finish="length"), delay=0.01))
        out = run(collect(make_front(VllmAdapter, bundle, fake), job(stop=("world",))))
        assert out.text == "Hello there, " and out.finished.reason == "stop" and out.finished.stop_reason == "world"
        assert "stop" not in fake.requests[0][1]["sampling_params"]  # never trimmed upstream
        assert fake.bodies[0].closed_early

    def test_logprobs_map_back_to_ids(self, bundle):
        ids = ids_of(bundle, "Hi there")
        fake = Fake(lambda body, path: ScriptedBody(generate_events(ids, logprobs=True, finish="length")))
        out = run(collect(make_front(VllmAdapter, bundle, fake), job(logprobs=True, top_logprobs=1)))
        assert [lp.token_id for lp in out.logprobs] == ids
        assert out.logprobs[0].logprob == -0.5 and out.logprobs[0].top == ((ids[0], -0.5),)
        assert fake.requests[0][1]["sampling_params"]["logprobs"] == 1


class TestCompletionsFallback:
    def test_falls_back_once_on_404_and_reads_usage(self, bundle):
        ids = ids_of(bundle, "Hi there")

        def respond(body, path):
            if path == GENERATE:
                return 404, {"detail": "Not Found"}
            return ScriptedBody(completion_events(ids))

        fake = Fake(respond)
        front = make_front(VllmAdapter, bundle, fake)
        first = run(collect(front, job(max_tokens=len(ids))))
        second = run(collect(front, job(max_tokens=len(ids))))
        assert first.text == second.text == "Hi there"
        assert [p for p, _ in fake.requests] == [GENERATE, COMPLETIONS, COMPLETIONS]
        body = fake.requests[1][1]
        assert body["prompt"] == [1, 2, 3] and body["return_token_ids"] is True and body["return_tokens_as_token_ids"]
        assert body["skip_special_tokens"] is False and "stop" not in body
        assert first.finished.cached_tokens == 7 and first.finished.prompt_tokens == 3

    def test_a_disabled_generate_endpoint_falls_back_once_and_says_so(self, bundle, capsys):
        """A stock `vllm serve` answers /inference/v1/generate with 403 unless started with --enable-scale-out."""
        ids = ids_of(bundle, "Hi there")
        disabled = {
            "error": {
                "message": "Scale-out endpoints are disabled. Restart vllm serve with "
                "--enable-scale-out to enable them.",
                "type": "PermissionDeniedError",
                "code": 403,
            }
        }

        def respond(body, path):
            return (403, disabled) if path == GENERATE else ScriptedBody(completion_events(ids))

        fake = Fake(respond)
        front = make_front(VllmAdapter, bundle, fake)
        outs = [run(collect(front, job(max_tokens=len(ids)))) for _ in range(2)]
        assert [o.text for o in outs] == ["Hi there", "Hi there"]
        assert [p for p, _ in fake.requests] == [GENERATE, COMPLETIONS, COMPLETIONS]
        logged = [line for line in capsys.readouterr().out.splitlines() if "upstream_api_fallback" in line]
        assert len(logged) == 1 and "403" in logged[0] and "--enable-scale-out" in logged[0]

    def test_requests_in_flight_before_the_switch_are_each_retried(self, bundle):
        """Several requests reach the generate endpoint before the first refusal comes back: every one is
        retried on completions (none fails), and the switch happens once."""
        ids = ids_of(bundle, "Hi")

        def respond(body, path):
            return (404, {"detail": "Not Found"}) if path == GENERATE else ScriptedBody(completion_events(ids))

        fake = Fake(respond)
        front = make_front(VllmAdapter, bundle, fake)

        async def together():
            return await asyncio.gather(*(collect(front, job(max_tokens=len(ids))) for _ in range(3)))

        outs = run(together())
        assert [o.text for o in outs] == ["Hi"] * 3 and all(o.start_error is None for o in outs)
        paths = [p for p, _ in fake.requests]
        assert paths.count(COMPLETIONS) == 3 and paths[:3] == [GENERATE] * 3

    @pytest.mark.parametrize("status", [403, 404])
    def test_no_fallback_when_the_api_is_pinned_or_from_completions(self, bundle, status):
        """`engine.api=generate` reports the refusal; so does a 403/404 from completions itself (a wrong
        `engine.model` is vLLM's 404 there): nothing is retried."""
        fake = Fake(lambda body, path: (status, {"error": {"message": "no", "code": status}}))
        pinned = run(collect(make_front(VllmAdapter, bundle, fake, api="generate"), job()))
        assert pinned.start_error is not None and [p for p, _ in fake.requests] == [GENERATE]
        fake.requests.clear()
        settled = run(collect(make_front(VllmAdapter, bundle, fake, api="completions"), job()))
        assert settled.start_error is not None and [p for p, _ in fake.requests] == [COMPLETIONS]

    def test_api_completions_never_tries_generate(self, bundle):
        fake = Fake(lambda body, path: ScriptedBody(completion_events(ids_of(bundle, "Hi"))))
        run(collect(make_front(VllmAdapter, bundle, fake, api="completions"), job()))
        assert [p for p, _ in fake.requests] == [COMPLETIONS]

    def test_text_without_token_ids_is_a_502(self, bundle):
        fake = Fake(lambda body, path: ScriptedBody([{"choices": [{"index": 0, "text": "hi", "finish_reason": None}]}]))
        out = run(collect(make_front(VllmAdapter, bundle, fake, api="completions"), job()))
        assert out.start_error is not None and out.start_error.status == 502


class TestErrors:
    @pytest.mark.parametrize(
        "status, body, expected, http",
        [
            (503, {"error": {"message": "loading"}}, UpstreamUnavailableError, 503),
            (429, {"error": {"message": "queue full"}}, UpstreamBusyError, 429),
            (
                400,
                {"error": {"message": "This model's maximum context length is 2048 tokens."}},
                ContextLengthError,
                400,
            ),
            (500, {"error": {"message": "CUDA out of memory"}}, UpstreamError, 502),
        ],
    )
    def test_status_before_the_first_byte_is_a_real_status(self, bundle, status, body, expected, http):
        fake = Fake(lambda b, path: (status, body))
        out = run(collect(make_front(VllmAdapter, bundle, fake, api="generate"), job()))
        assert isinstance(out.start_error, expected) and out.start_error.status == http
        if http in (429, 503):
            assert out.start_error.headers["Retry-After"]
        if expected is ContextLengthError:
            assert out.start_error.code == "context_length_exceeded"
            assert "maximum context length is" in out.start_error.message

    def test_unreachable_is_503_naming_the_upstream(self, bundle):
        fake = Fake.down()
        front = make_front(VllmAdapter, bundle, fake)
        out = run(collect(front, job()))
        assert out.start_error.status == 503 and "upstream.test:8000" in out.start_error.message
        assert out.start_error.headers["Retry-After"] == "2" and out.start_error.code == "upstream_unavailable"
        assert front.admission.in_use == 0

    def test_garbage_mid_stream_is_an_in_stream_error(self, bundle):
        ids = ids_of(bundle, "Hi there")
        events = generate_events(ids, per_chunk=1, finish="length")[:1] + [b"data: {not json\n\n"]
        fake = Fake(lambda b, path: ScriptedBody(events))
        out = run(collect(make_front(VllmAdapter, bundle, fake), job()))
        assert out.start_error is None and out.text and out.error.status == 502

    def test_abort_finish_is_an_error_not_a_stop(self, bundle):
        ids = ids_of(bundle, "Hi there")
        fake = Fake(lambda b, path: ScriptedBody(generate_events(ids, per_chunk=1, finish="abort")))
        out = run(collect(make_front(VllmAdapter, bundle, fake), job()))
        assert out.finished is None and out.error.status == 502 and "abort" in out.error.message

    def test_stream_cut_before_finish_is_502(self, bundle):
        ids = ids_of(bundle, "Hi there")
        events = generate_events(ids, per_chunk=1, finish="length")[:-1]
        fake = Fake(lambda b, path: ScriptedBody(events, tail=b""))
        out = run(collect(make_front(VllmAdapter, bundle, fake), job()))
        assert out.error is not None and out.error.status == 502 and out.finished is None

    def test_connection_dropped_mid_stream_is_502(self, bundle):
        ids = ids_of(bundle, "Hi there")
        events = generate_events(ids, per_chunk=1)[:1] + [DROP]
        fake = Fake(lambda b, path: ScriptedBody(events))
        out = run(collect(make_front(VllmAdapter, bundle, fake), job()))
        assert out.error is not None and out.error.status == 502


class TestCancellation:
    def test_client_leaving_closes_the_upstream_request_and_frees_capacity(self, bundle):
        ids = ids_of(bundle) * 4
        fake = Fake(lambda b, path: ScriptedBody(generate_events(ids, per_chunk=1, finish="length"), delay=0.02))
        front = make_front(VllmAdapter, bundle, fake)
        out = run(collect(front, job(max_tokens=len(ids)), stop_after=2))
        assert fake.bodies[0].closed_early and out.finished is None
        assert front.admission.in_use == 0

    def test_capacity_is_max_inflight(self, bundle):
        fake = Fake(lambda b, path: ScriptedBody([]))
        front = make_front(VllmAdapter, bundle, fake, max_inflight=3)
        assert front.admission.capacity == 3


class TestObserver:
    def test_latency_and_errors_by_kind_reach_the_metrics(self, bundle):
        from deltafin.metrics import Metrics

        metrics = Metrics()
        ids = ids_of(bundle, "Hi")
        answers = iter([(429, {"error": {"message": "full"}}), ScriptedBody(generate_events(ids, finish="length"))])
        front = make_front(VllmAdapter, bundle, Fake(lambda b, p: next(answers), refuse=1), api="generate")
        front.observe(metrics)
        for _ in range(3):
            run(collect(front, job()))
        text = metrics.render().decode()
        assert 'deltafin_upstream_errors_total{engine="vllm",kind="unreachable"} 1.0' in text
        assert 'deltafin_upstream_errors_total{engine="vllm",kind="upstream_busy"} 1.0' in text
        assert 'deltafin_upstream_seconds_count{engine="vllm"} 1.0' in text
