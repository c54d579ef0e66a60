"""Codex CLI, unmodified, completes an `exec` turn against `python -m deltafin` (its model is `codex-qwen3`, an
entry of the shared local server, tests/shared_server.py).

Codex sends ~40 KB a turn (~27,000 tokens with a tiny model's tokenizer): developer messages, function tools, a
`namespace` group, a hosted web_search tool, reasoning, include, store:false, prompt_cache_key, client_metadata.
A tiny Qwen3 model with a 64k context takes it. It is taught to end its turn at once whatever comes before
the assistant turn (random token prefixes of several lengths): taught on short prompts, a 2-layer model gets the
first token of a 27,000-token prompt right but not the ones after it, so a longer scripted answer would loop
until the context ends. Codex's own request is first recorded against a stand-in, and checked to still carry
what this test is about."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from deltafin.tiny import write_tiny_model
from deltafin.tiny.taught import taught
from tests.conftest import TINY_OVERRIDES
from tests.e2e.codex_cli import codex_exec
from tests.e2e.stand_in import stand_in
from tests.shared_server import shared_model

pytestmark = pytest.mark.e2e

CONTEXT = 65536


def recorded_codex_body(tmp_path) -> dict:
    """Codex's first request, as it sends it (the stand-in refuses it, so Codex stops there)."""
    refusal = {"error": {"message": "recorded", "type": "invalid_request_error", "param": None, "code": None}}
    with stand_in(lambda bodies: (400, refusal)) as (base_url, bodies):
        codex_exec(base_url, CODEX.name, "Say hi", tmp_path / "home", tmp_path / "work")
    assert bodies, "Codex sent nothing"
    return bodies[0]


def prepare(root: Path) -> tuple[Path, list[str]]:
    path = write_tiny_model("qwen3", root / "model", context=CONTEXT)
    tokenizer = AutoTokenizer.from_pretrained(path)
    turn_end = tokenizer("<|im_end|>\n<|im_start|>assistant\n").input_ids
    words = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    rng = random.Random(0)
    # (cached by what it is made from, as the other taught models are: the shared server's start waits for it)
    path = taught(
        path, [([rng.choice(words) for _ in range(n)] + turn_end, "<|im_end|>") for n in (4, 64, 256)], steps=150
    )
    # Thinking stays on (conf/model/qwen3.yaml): the assistant turn starts right after `assistant\n`, as taught.
    return path, [*TINY_OVERRIDES["qwen3"], f"model.path={path}"]


#: the taught model, an entry of the shared local server (Codex's config names it)
CODEX = shared_model("codex-qwen3", prepare)


@pytest.fixture(scope="module")
def codex_server(local_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("codex")
    body = recorded_codex_body(root / "record")
    kinds = {tool["type"] for tool in body["tools"]}
    assert {"function", "namespace", "web_search"} <= kinds and body["store"] is False
    assert "reasoning.encrypted_content" in body["include"] and len(json.dumps(body)) > 20_000
    assert any(item.get("role") == "developer" for item in body["input"])
    return local_server, root


def test_codex_exec_completes_a_turn(codex_server):
    server, root = codex_server
    result = codex_exec(f"{server.base_url}/v1", CODEX.name, "Say hi", root / "home", root / "work")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "ERROR" not in result.stdout + result.stderr
    # The shared server logs every module's requests: this turn's are the ones its model answered (the access
    # log names it; Codex sends no x-request-id of its own).
    lines = [json.loads(line) for line in server.log_lines() if line.startswith("{")]
    turns = [
        line
        for line in lines
        if line.get("event") == "request" and line.get("route") == "/v1/responses" and line.get("model") == CODEX.name
    ]
    assert turns and all(t["status"] == 200 and t["completed"] for t in turns)
    assert turns[0]["prompt_tokens"] > 20_000 and turns[0]["finish_reasons"] == ["stop"]
    ids = {turn["request_id"] for turn in turns}
    dropped = [
        line for line in lines if line.get("event") == "responses_tools_dropped" and line.get("request_id") in ids
    ]
    assert dropped and "web_search" in dropped[0]["tools"]
