"""Speculative decoding over HTTP with the openai client: the default model with n-gram speculation (the default
method) answers exactly as the same model without it, streamed or not; its request log line says how many
guesses were kept, and /metrics counts them by model."""

from __future__ import annotations

import re
import uuid

import httpx
import openai
import pytest

from tests.conftest import LiveServer
from tests.engine.test_speculative import COPY
from tests.shared_server import shared_model

pytestmark = pytest.mark.e2e

#: the default model with n-gram speculation (the default method), memo off (every request really runs), beside
#: the same model without speculation
NGRAM = shared_model("ngram", lambda root: (None, ["server.memo.entries=0"]))
NONE = shared_model("no-speculation", lambda root: (None, ["engine.speculative.method=none"]))


def ask(client: openai.OpenAI, model: str, *, stream: bool, request_id: str | None = None) -> str:
    kwargs = dict(model=model, messages=[{"role": "user", "content": COPY}], max_tokens=90, temperature=0)
    headers = {"x-request-id": request_id} if request_id else None
    if not stream:
        return client.chat.completions.create(**kwargs, extra_headers=headers).choices[0].message.content or ""
    chunks = client.chat.completions.create(**kwargs, stream=True, extra_headers=headers)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def counter(metrics: str, name: str, model: str) -> float:
    found = re.search(rf'^{name}{{model="{re.escape(model)}"}} ([0-9.e+]+)$', metrics, re.M)
    return float(found.group(1)) if found else 0.0


def test_the_same_answer_with_guesses_kept_logged_and_counted(local_server: LiveServer):
    client = openai.OpenAI(base_url=f"{local_server.base_url}/v1", api_key="x", max_retries=0, timeout=300)
    plain = ask(client, NONE.name, stream=False)
    before = httpx.get(f"{local_server.base_url}/metrics").text
    request_id = uuid.uuid4().hex
    assert ask(client, NGRAM.name, stream=True, request_id=request_id) == plain
    assert ask(client, NGRAM.name, stream=False) == plain
    line = local_server.request_log(request_id)
    assert line["model"] == NGRAM.name and line["spec_accepted_tokens"] > 10
    assert line["spec_draft_tokens"] >= line["spec_accepted_tokens"]
    assert line["spec_acceptance"] == round(line["spec_accepted_tokens"] / line["spec_draft_tokens"], 4)
    after = httpx.get(f"{local_server.base_url}/metrics").text
    for name in ("deltafin_spec_draft_tokens_total", "deltafin_spec_accepted_tokens_total"):
        assert counter(after, name, NGRAM.name) - counter(before, name, NGRAM.name) > 2 * 10
        assert counter(after, name, NONE.name) == 0
    plain_id = uuid.uuid4().hex
    ask(client, NONE.name, stream=True, request_id=plain_id)
    assert "spec_draft_tokens" not in local_server.request_log(plain_id)
