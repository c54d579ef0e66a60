"""Claude Code, unmodified, completes a `claude -p` turn against `python -m deltafin` over the Messages API (its
model is `claude-code-qwen3`, an entry of the shared local server, tests/shared_server.py, reached through the
alias pattern `claude-*`: Claude Code is given no model and sends its default, `claude-opus-...`).

Claude Code's own request is first recorded against a stand-in and checked to still carry what this test is
about: the billing-header system block, a `role: "system"` turn after the user's, adaptive thinking, streaming,
tools (`--tools Bash` keeps the prompt at ~4,000 tokens instead of ~34,000 with every tool: the tiny model's
prefill on 2 CPU cores is the cost). The model is a tiny Qwen3 taught to answer "Hi" and end its turn whatever
comes before the assistant turn (random token prefixes of several lengths)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from deltafin.tiny import write_tiny_model
from deltafin.tiny.taught import taught
from tests.conftest import TINY_OVERRIDES
from tests.e2e.claude_code import claude_code_binary, claude_print
from tests.e2e.stand_in import stand_in
from tests.shared_server import shared_model
from tests.tiers import unavailable

pytestmark = pytest.mark.e2e

if not claude_code_binary().exists():
    unavailable("claude_code", f"Claude Code not installed ({claude_code_binary()}); run scripts/install-claude-code")

CONTEXT = 16384
REPLY = "Hi"
#: Claude Code's tools, cut to one
TOOLS = ("--tools", "Bash")


def prepare(root: Path) -> tuple[Path, list[str]]:
    path = write_tiny_model("qwen3", root / "model", context=CONTEXT)
    tokenizer = AutoTokenizer.from_pretrained(path)
    turn_end = tokenizer("<|im_end|>\n<|im_start|>assistant\n").input_ids
    words = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    rng = random.Random(0)
    examples = [([rng.choice(words) for _ in range(n)] + turn_end, REPLY + "<|im_end|>") for n in (4, 64, 256, 1024)]
    path = taught(path, examples, steps=400)  # cached by what it is made from
    # Greedy by default: Claude Code sends no temperature, and the taught reply is one sure answer, not a sample
    # (the checkpoint's own sampling, Qwen3's 0.6, sometimes wrote "HHi").
    greedy = ["model.sampling_source=config", "model.sampling.temperature=0"]
    return path, [*TINY_OVERRIDES["qwen3"], f"model.path={path}", "model.aliases=[claude-*]", *greedy]


CLAUDE = shared_model("claude-code-qwen3", prepare)


def recorded_request(root: Path) -> dict:
    """Claude Code's first request, as it sends it (the stand-in refuses it, so Claude Code stops there)."""
    refusal = {"type": "error", "error": {"type": "invalid_request_error", "message": "recorded"}}
    with stand_in(lambda bodies: (400, refusal)) as (base_url, bodies):
        claude_print(base_url.removesuffix("/v1"), "What is 2+2?", root, *TOOLS, CLAUDE_CODE_MAX_RETRIES="0")
    assert bodies, "Claude Code sent nothing"
    return bodies[0]


def test_claude_code_completes_a_turn(local_server, tmp_path):
    body = recorded_request(tmp_path / "record")
    assert body["model"].startswith("claude-") and body["stream"] is True
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header:")
    assert [m["role"] for m in body["messages"]] == ["user", "system"]
    assert body["thinking"]["type"] == "adaptive" and "Bash" in [tool["name"] for tool in body["tools"]]

    result = claude_print(local_server.base_url, "What is 2+2?", tmp_path / "home", *TOOLS)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    answer = json.loads(result.stdout)
    assert answer["is_error"] is False and answer["terminal_reason"] == "completed", answer
    assert answer["result"] == REPLY and answer["num_turns"] == 1 and answer["stop_reason"] == "end_turn"
    # The shared server logs every module's requests: this turn's are the ones its model answered.
    lines = [json.loads(line) for line in local_server.log_lines() if line.startswith("{")]
    turns = [line for line in lines if line.get("event") == "request" and line.get("route") == "/v1/messages"]
    answered = [line for line in turns if line.get("model") == CLAUDE.name]
    assert answered and all(line["status"] == 200 for line in answered), turns[-3:]
    assert answered[-1]["prompt_tokens"] > 2000  # the whole of Claude Code's prompt, not a stub
