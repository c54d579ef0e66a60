"""Time to first token of Claude Code's next session, with the billing-header line dropped (Deltafin as it is) and
kept (as a server that did not drop it).

    flock /tmp/deltafin-bench.lock .venv/bin/python bench/claude_code_prefix.py [--sessions 4] [override ...]

Every `claude -p` run is a session whose first system block is `x-anthropic-billing-header: cc_version=
2.1.332.XYZ; ...`, XYZ a hash of the session's first prompt; the rest of its prompt's head (the system prompt,
the tools) is the same from session to session. This records the first request of `--sessions` real Claude Code
runs with different prompts, one user in one project folder (Claude Code from scripts/install-claude-code against
a stand-in that records and refuses; `--tools ""`, so the default model, which has no tool-call parser, can serve
them), then replays them in order to a server of the default model (the real SmolLM2; memo off), streamed, max_tokens 1:
- dropped: the bodies as recorded; Deltafin leaves the billing block out of the prompt;
- kept: the same bodies with the block renamed (`x-anthropic-billing-header-kept:`), which Deltafin keeps in the
  prompt, as a server that did not drop the line would: each session's prompt then differs from its head on.
Each variant on a fresh server. For every session after the first: the client's time to the first event after
the pings (the first token), and the server's prefill time and cached tokens from its log.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deltafin.testing import LiveServer  # noqa: E402
from tests.e2e.claude_code import claude_print  # noqa: E402
from tests.e2e.stand_in import stand_in  # noqa: E402

PROMPTS = [
    "What is 2+2?",
    "Name a prime number.",
    "Say hello in French.",
    "What colour is the sky?",
    "Count to three.",
    "Spell cat.",
    "What is the capital of Italy?",
    "Name a fruit.",
]
BILLING = "x-anthropic-billing-header:"


def recorded(prompts: list[str]) -> list[dict]:
    """The first request of one Claude Code session per prompt."""
    refusal = {"type": "error", "error": {"type": "invalid_request_error", "message": "recorded"}}
    bodies: list[dict] = []
    with tempfile.TemporaryDirectory() as root:
        for prompt in prompts:
            with stand_in(lambda got: (400, refusal)) as (base_url, got):
                claude_print(
                    base_url.removesuffix("/v1"),
                    prompt,
                    Path(root),  # one user, one project: the sessions' memory folder and cwd are the same
                    "--tools",
                    "",
                    CLAUDE_CODE_MAX_RETRIES="0",
                )
            bodies.append(got[0])
    return bodies


def kept(body: dict) -> dict:
    body = copy.deepcopy(body)
    for block in body["system"]:
        if block["text"].startswith(BILLING):
            block["text"] = block["text"].replace(BILLING, "x-anthropic-billing-header-kept:", 1)
    return body


def first_token_ms(base_url: str, body: dict, request_id: str) -> float:
    """Time to the first event that follows the first token (a content block, or the message's end)."""
    started = time.perf_counter()
    first = None
    with httpx.stream(
        "POST",
        f"{base_url}/v1/messages?beta=true",
        json={**body, "model": "smollm2", "max_tokens": 1, "stream": True},
        headers={"x-request-id": request_id, "anthropic-version": "2023-06-01"},
        timeout=600,
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("event: ") and line[7:] not in ("message_start", "ping"):
                first = time.perf_counter() - started
    assert first is not None, "no token came back"
    return first * 1000


def replay(bodies: list[dict], overrides: list[str]) -> list[dict]:
    server = LiveServer(["server.memo.entries=0", "server.queue.timeout_s=600", *overrides])
    rows = []
    try:
        server.wait_ready()
        for i, body in enumerate(bodies):
            request_id = uuid.uuid4().hex
            ttft = first_token_ms(server.base_url, body, request_id)
            entry = server.request_log(request_id)
            if i:  # the first session fills the cache; the ones after it are timed
                rows.append(
                    {
                        "ttft_ms": ttft,
                        "prefill_ms": entry["prefill_ms"],
                        "prompt": entry["prompt_tokens"],
                        "cached": entry["cached_tokens"],
                    }
                )
    finally:
        server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the server")
    args = parser.parse_args()
    bodies = recorded(PROMPTS[: args.sessions])
    lines = {b["system"][0]["text"] for b in bodies}
    assert len(lines) == len(bodies), "the sessions' billing lines should differ"
    results = {"dropped": replay(bodies, args.overrides), "kept": replay([kept(b) for b in bodies], args.overrides)}
    print(f"{len(bodies)} sessions, load average {os.getloadavg()[0]:.1f}")
    for name, rows in results.items():
        print(
            f"{name}: TTFT median {statistics.median(r['ttft_ms'] for r in rows):.0f} ms, server prefill median "
            f"{statistics.median(r['prefill_ms'] for r in rows):.0f} ms; {json.dumps(rows)}"
        )
    ratio = statistics.median(r["ttft_ms"] for r in results["kept"]) / statistics.median(
        r["ttft_ms"] for r in results["dropped"]
    )
    print(f"kept / dropped TTFT: {ratio:.1f}x")


if __name__ == "__main__":
    main()
