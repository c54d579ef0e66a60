"""Continuous batching over HTTP: concurrent clients decode side by side and get what they would get alone."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from tests.conftest import LiveServer
from tests.shared_server import shared_model

pytestmark = pytest.mark.e2e

PROMPTS = ["Name a colour.", "Count to five.", "Say hello in French.", "What is two plus two?"]


#: the default model on the shared server with the memo off, so every request really runs; four rows decode together
BATCHED = shared_model("batched", lambda root: (None, ["engine.max_batch=4", "server.memo.entries=0"]))


@pytest.fixture(scope="module")
def batched_server(local_server: LiveServer) -> LiveServer:
    return local_server


def stream(client: openai.OpenAI, prompt: str, out: dict) -> None:
    chunks = client.chat.completions.create(
        model=BATCHED.name,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=24,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = []
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            out.setdefault("first", time.monotonic())
            text.append(chunk.choices[0].delta.content)
    out["end"], out["text"] = time.monotonic(), "".join(text)


def test_concurrent_streams_overlap_and_match_their_solo_runs(batched_server):
    client = openai.OpenAI(base_url=f"{batched_server.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    alone = []
    for prompt in PROMPTS:
        out: dict = {}
        stream(client, prompt, out)
        alone.append(out["text"])
    together = [{} for _ in PROMPTS]
    threads = [threading.Thread(target=stream, args=(client, p, o)) for p, o in zip(PROMPTS, together)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [o["text"] for o in together] == alone  # greedy: the batch changes nothing
    # Every stream had produced text before any of them finished: they decoded side by side, not in turn.
    assert max(o["first"] for o in together) < min(o["end"] for o in together)
