"""Kimi K3 through the real server: `python -m deltafin model=kimi_k3` on the tiny K3 in the released checkpoint's
layout (a vision tower beside the language model, every released feature on: Deltafin's own K3 class), driven
by the openai client. The oracle is the checkpoint's own model code (the reference, tests/k3_reference.py) on the
same weights: greedy tokens alone, four at once, after a saved state is reused and from the memo are its own;
a chat turn's answer is what K3's parser makes of the reference's tokens. A K3 turning on what Deltafin does not
implement keeps the server up and says why on /health."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from deltafin.tiny import write_tiny_model
from tests.conftest import TINY_OVERRIDES, LiveServer
from tests.k3_reference import checkpoint_state, reference_greedy, reference_model
from tests.shared_server import shared_model

pytestmark = pytest.mark.e2e

WORDS = "The quick brown fox jumps over the lazy dog. What is the weather in Paris today? It is sunny and warm."


def _k3(root: Path) -> tuple[Path, list[str]]:
    """The tiny K3 (released layout) under root/k3."""
    folder = write_tiny_model("kimi_k3", root / "k3")
    return folder, [*TINY_OVERRIDES["kimi_k3"], f"model.path={folder}", "server.prefix_cache.min_tokens=8"]


#: served as the family's own name, which the tests send
K3 = shared_model("kimi-k3", _k3)


@pytest.fixture(scope="module")
def k3(local_server):
    """(the K3 folder, the shared server serving it as kimi-k3)."""
    return K3.folder, local_server


@pytest.fixture(scope="module")
def oracle(k3):
    """The reference model on the folder's weights: (ids, n) -> its greedy tokens."""
    folder, _ = k3
    text = json.loads((folder / "config.json").read_text())["text_config"]
    reference = reference_model(text, checkpoint_state(folder))
    return lambda ids, n: reference_greedy(reference, ids, n)


@pytest.fixture(scope="module")
def prompts(k3):
    tokenizer = AutoTokenizer.from_pretrained(k3[0])
    words = WORDS.split()
    return [
        tokenizer(" ".join(words[i:] + words[:i]), add_special_tokens=False).input_ids[: 12 + 5 * i] for i in range(4)
    ]


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=300)


def failed_health(server: LiveServer, timeout: float = 240.0) -> httpx.Response:
    """/health once the server reports its load failed (it stays up to say so)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.process.poll() is None, "the server exited instead of reporting the failed load"
        try:
            health = httpx.get(f"{server.base_url}/health", timeout=1)
            if health.json().get("status") == "failed":
                return health
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the load did not fail")


def complete(server: LiveServer, ids: list[int], n: int = 10, *, with_id: bool = False):
    """Greedy token ids for a token-id prompt, and the response's usage (and its request id)."""
    raw = client(server).completions.with_raw_response.create(
        model="kimi-k3",
        prompt=ids,
        max_tokens=n,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    response = raw.parse()
    out = response.choices[0].model_extra["token_ids"], response.usage
    return (*out, raw.headers["x-request-id"]) if with_id else out


def overlapping(lines: list[dict]) -> bool:
    """Some two of these requests were in the server at the same time (from their access-log lines)."""
    spans = sorted(
        (end - line["total_ms"] / 1000, end)
        for line in lines
        for end in [datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()]
    )
    return any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:]))


def test_greedy_tokens_are_the_references(k3, oracle, prompts):
    _, server = k3
    for ids in prompts[:2]:
        tokens, usage = complete(server, ids)
        assert tokens == oracle(ids, 10) and usage.prompt_tokens == len(ids)


def test_four_concurrent_requests_equal_their_solo_runs(k3, oracle, prompts):
    _, server = k3
    solo = [oracle(ids, 40) for ids in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda ids: complete(server, ids, 40, with_id=True), prompts))
    assert [tokens for tokens, _, _ in together] == solo
    assert overlapping([server.request_log(request_id) for _, _, request_id in together])


def test_a_conversation_reuses_the_saved_state_exactly(k3, oracle, prompts):
    """Turn two extends turn one (prompt, answer, more): it starts from the state turn one's row left, and its
    tokens are a cold run's. A prompt that leaves turn one's prompt before its end cannot use that state: it
    starts from a checkpoint before the edit at most (the end of an earlier prompt it starts with, if any)."""
    _, server = k3
    first = prompts[3] + prompts[0][:3]  # a prompt no other test sent
    answer, usage = complete(server, first, 6)
    second = first + answer + prompts[1][:5]
    tokens, usage = complete(server, second, 8)
    assert usage.prompt_tokens_details.cached_tokens == len(first) + len(answer) - 1
    assert tokens == oracle(second, 8)
    edited = first[:-2] + prompts[2][:4]
    tokens, usage = complete(server, edited, 8)
    assert usage.prompt_tokens_details.cached_tokens <= len(first) - 2 and tokens == oracle(edited, 8)


def test_a_chat_turn_is_the_references_answer_and_the_memo_replays_it(k3, oracle):
    """A second chat turn through the chat API: its answer is what the family's parser makes of the reference's
    greedy tokens for the prompt /tokenize shows; the same request again replays it from the memo.

    (Whether it reuses turn one's saved state depends on the render: a state is reused only when the new
    prompt starts with all the tokens it holds, and K3's prompt renders a history turn without the
    think channel the generation prompt opened.)"""
    folder, server = k3
    chat = client(server).chat.completions
    messages = [{"role": "user", "content": "What is the weather in Paris today?"}]
    first = chat.create(model="kimi-k3", messages=messages, max_tokens=6, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or "ok"},
        {"role": "user", "content": "And in Berlin?"},
    ]
    second = chat.with_raw_response.create(model="kimi-k3", messages=messages, max_tokens=6, temperature=0)
    ids = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages, "model": K3.name}).json()["tokens"]
    # A stream cut by max_tokens inside a character ends without its partial bytes (vLLM's detokenizer does
    # the same); a full decode shows them as U+FFFD.
    text = AutoTokenizer.from_pretrained(folder).decode(oracle(ids, 6)).rstrip("\ufffd")
    expected = httpx.post(f"{server.base_url}/parse", json={"text": text, "model": K3.name}).json()["message"]
    message = second.parse().choices[0].message
    assert (message.content or "", message.reasoning_content or "") == (
        expected.get("content") or "",
        expected.get("reasoning_content") or "",
    )
    assert server.request_log(second.headers["x-request-id"])["memo_hit"] is False
    again = chat.with_raw_response.create(model="kimi-k3", messages=messages, max_tokens=6, temperature=0)
    assert again.parse().choices[0].message == message
    assert server.request_log(again.headers["x-request-id"])["memo_hit"] is True


def test_an_image_part_is_a_400_naming_it(k3):
    _, server = k3
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).chat.completions.create(
            model="kimi-k3",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                    ],
                }
            ],
        )
    assert refused.value.body["param"] == "messages[0].content[1]"


def test_a_k3_the_engine_cannot_run_keeps_the_server_up_and_says_why(k3, tmp_path):
    """A K3 language model with rotary MLA, which the reference asserts against and Deltafin does not run."""
    folder, _ = k3
    config = json.loads((folder / "config.json").read_text())
    config["text_config"].update(mla_use_nope=False)
    for path in folder.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    server = LiveServer([*TINY_OVERRIDES["kimi_k3"], f"model.path={tmp_path}"])
    try:
        health = failed_health(server)
        assert health.status_code == 503
        error = health.json()["error"]
        assert error.startswith("model.path: KimiK3ForConditionalGeneration (kimi_k3) cannot run on the local engine")
        assert "rotary MLA (mla_use_nope is not true" in error and "\n" not in error
        with pytest.raises(openai.APIStatusError) as refused:
            client(server).chat.completions.create(model="kimi-k3", messages=[{"role": "user", "content": "hi"}])
        assert refused.value.status_code == 503 and refused.value.body["code"] == "model_load_failed"
    finally:
        server.stop()
