"""A coding agent's session replayed against the prefix cache: a long system prompt with tool definitions, then
turns that each resend the whole conversation grown by one scripted assistant reply and one user message, with a
restart of every server midway. Time to first token per turn, measured by the client (streamed):

- Deltafin with its prefix cache (RAM, and the disk tier in a temporary folder, which the restart keeps);
- Deltafin cold: the same server with `server.prefix_cache.enabled=false` (every turn prefilled whole);
- llama-server on the same GGUF with its slot cache: `cache_prompt` (the slot keeps the last prompt's KV), and
  `--slot-save-path`: the slot is saved before the restart and restored after it (the restore's own time is
  reported beside the first turn after it);
- llama-server cold (`cache_prompt: false`, its RAM prompt cache off), for its own ratio.

    flock /tmp/deltafin-bench.lock .venv/bin/python bench/agent_session.py [--turns 10] [--restart-after 5]
        [--system-tokens 5600] [--no-llama] [override ...]

The replies are scripted (a replay of a recorded session), so every system sees the same token ids each turn;
llama-server gets the ids Deltafin's chat template renders, through `/completion`. SmolLM2's context is 8192
(`model.context_length`; llama-server runs with `-c 8192`), so the system prompt is ~5.6k tokens rather than the
~20k of a Claude Code session, and the last turn's prompt stays under the context with room for the answer.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deltafin.testing import LiveServer, compose_config  # noqa: E402
from deltafin.testing.llama_server import start_llama_server  # noqa: E402

CONTEXT = 8192
ANSWER_TOKENS = 8
WORDS = [
    "agent",
    "tool",
    "file",
    "path",
    "repository",
    "test",
    "build",
    "change",
    "diff",
    "patch",
    "review",
    "command",
    "shell",
    "output",
    "error",
    "stack",
    "trace",
    "function",
    "module",
    "class",
    "method",
    "argument",
    "return",
    "value",
    "config",
    "option",
    "flag",
    "environment",
    "variable",
    "branch",
    "commit",
    "merge",
    "conflict",
    "lint",
    "type",
    "check",
    "format",
    "style",
    "guide",
    "dependency",
    "version",
    "package",
    "install",
    "update",
    "remove",
    "search",
    "read",
    "write",
    "edit",
    "create",
    "delete",
    "rename",
    "move",
    "copy",
    "list",
    "directory",
    "workspace",
    "project",
    "user",
    "request",
    "task",
    "plan",
    "step",
    "verify",
    "result",
    "summary",
    "report",
    "careful",
    "minimal",
    "focused",
    "safe",
    "explicit",
    "clear",
    "concise",
    "precise",
    "complete",
]
TOOLS = [
    "read_file",
    "write_file",
    "edit_file",
    "list_dir",
    "glob",
    "grep",
    "run_shell",
    "run_tests",
    "git_status",
    "git_diff",
    "git_commit",
    "search_web",
    "fetch_url",
    "open_pr",
    "comment_pr",
    "create_issue",
    "todo_write",
    "notebook_edit",
    "ask_user",
    "task",
]


def system_prompt(tokens: int, tokenizer) -> str:
    """Instructions and tool schemas, deterministic, about `tokens` tokens long."""
    rng = random.Random(0)
    tools = []
    for name in TOOLS:
        params = {
            f"{rng.choice(WORDS)}_{i}": {
                "type": rng.choice(["string", "integer", "boolean"]),
                "description": " ".join(rng.choices(WORDS, k=8)),
            }
            for i in range(4)
        }
        tools.append({"name": name, "description": " ".join(rng.choices(WORDS, k=30)), "parameters": params})
    parts = ["You are a coding agent working in the user's repository. Tools:", json.dumps(tools, indent=1)]
    while len(tokenizer("\n".join(parts), add_special_tokens=False).input_ids) < tokens:
        parts.append(" ".join(rng.choices(WORDS, k=60)).capitalize() + ".")
    return "\n".join(parts)


def conversation(turns: int) -> list[tuple[str, str]]:
    """(user message, the assistant's scripted reply) per turn."""
    rng = random.Random(1)
    out = []
    for turn in range(turns):
        user = f"Turn {turn + 1}: " + " ".join(rng.choices(WORDS, k=40)) + f" in src/module_{turn}.py."
        call = {
            "tool": rng.choice(TOOLS),
            "arguments": {"path": f"src/module_{turn}.py", "note": " ".join(rng.choices(WORDS, k=12))},
        }
        reply = " ".join(rng.choices(WORDS, k=25)) + ".\n" + json.dumps(call)
        out.append((user, reply))
    return out


def messages_for(system: str, turns: list[tuple[str, str]], upto: int) -> list[dict]:
    messages = [{"role": "system", "content": system}]
    for user, reply in turns[:upto]:
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": reply})
    messages.append({"role": "user", "content": turns[upto][0]})
    return messages


def deltafin_ttft(base_url: str, messages: list[dict]) -> tuple[float, int]:
    """(seconds to the first content chunk, usage's cached_tokens)."""
    body = {
        "messages": messages,
        "max_tokens": ANSWER_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first, cached = None, -1
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=900) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first is not None, "no content came back"
    return first, cached


def llama_ttft(base_url: str, ids: list[int], cache_prompt: bool) -> tuple[float, int]:
    """(seconds to the first content chunk, prompt tokens it had to process)."""
    body = {"prompt": ids, "n_predict": ANSWER_TOKENS, "temperature": 0, "stream": True, "cache_prompt": cache_prompt}
    started = time.perf_counter()
    first, processed = None, -1
    with httpx.stream("POST", f"{base_url}/completion", json=body, timeout=900) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("content"):
                first = time.perf_counter() - started
            if chunk.get("timings"):
                processed = chunk["timings"].get("prompt_n", -1)
    assert first is not None, "no content came back"
    return first, processed


class LlamaWarm:
    """llama-server with one slot, its prompt cache and a slot save folder; restarted on the same folder."""

    def __init__(self, gguf: Path, folder: str) -> None:
        self.gguf, self.folder = gguf, folder
        self.process, self.url = self._start()

    def _start(self):
        return start_llama_server(
            self.gguf, parallel=1, context=CONTEXT, threads=2, extra=["--slot-save-path", self.folder]
        )

    def restart(self) -> float:
        """Saves the slot, stops, starts again and restores it; returns the restore's seconds."""
        httpx.post(f"{self.url}/slots/0?action=save", json={"filename": "agent.bin"}, timeout=300).raise_for_status()
        self.process.terminate()
        self.process.wait(30)
        self.process, self.url = self._start()
        started = time.perf_counter()
        httpx.post(f"{self.url}/slots/0?action=restore", json={"filename": "agent.bin"}, timeout=300).raise_for_status()
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--restart-after", type=int, default=5, help="restart every server after this many turns")
    parser.add_argument("--system-tokens", type=int, default=5600)
    parser.add_argument("--no-llama", action="store_true", help="leave llama-server out")
    parser.add_argument("--llama-cold", action="store_true", help="also llama-server without its cache (its own ratio)")
    parser.add_argument("--no-cold", action="store_true", help="leave Deltafin's cold server out (a quick look)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here too")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both Deltafin servers")
    args = parser.parse_args()

    from deltafin.engine.weights.paths import resolve_model_path
    from deltafin.engine.weights.tokenizer_only import load_tokenizer_only

    config = compose_config(args.overrides)
    tokenizer = load_tokenizer_only(config.model).tokenizer
    system = system_prompt(args.system_tokens, tokenizer)
    turns = conversation(args.turns)
    prompts = []
    for turn in range(args.turns):
        rendered = tokenizer.apply_chat_template(
            messages_for(system, turns, turn), add_generation_prompt=True, tokenize=True
        )
        prompts.append(
            list(rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered)
        )
    assert len(prompts[-1]) + ANSWER_TOKENS <= CONTEXT, f"the last turn ({len(prompts[-1])} tokens) does not fit"
    print(f"prompt tokens per turn: {[len(p) for p in prompts]}", flush=True)

    disk = tempfile.mkdtemp(prefix="deltafin-agent-kv-")
    slots = tempfile.mkdtemp(prefix="llama-slots-")
    common = ["server.memo.entries=0", "server.queue.timeout_s=900", *args.overrides]
    warm = LiveServer([*common, f"server.prefix_cache.disk_dir={disk}"])
    cold = None if args.no_cold else LiveServer([*common, "server.prefix_cache.enabled=false"])
    llama = llama_cold = None
    rows = []
    try:
        warm.wait_ready()
        if cold is not None:
            cold.wait_ready()
        if not args.no_llama:
            gguf = resolve_model_path(config.model.path)
            llama = LlamaWarm(gguf, slots)
            if args.llama_cold:
                llama_cold = start_llama_server(
                    gguf, parallel=1, context=CONTEXT, threads=2, extra=["--cache-ram", "0"]
                )
        restore_s = None
        for turn in range(args.turns):
            if turn == args.restart_after:
                warm.stop()
                warm.restart()
                warm.wait_ready()
                if llama is not None:
                    restore_s = llama.restart()
            messages = messages_for(system, turns, turn)
            row = {"turn": turn + 1, "prompt_tokens": len(prompts[turn]), "restart": turn == args.restart_after}
            row["deltafin_s"], row["cached_tokens"] = deltafin_ttft(warm.base_url, messages)
            if cold is not None:
                row["cold_s"], _ = deltafin_ttft(cold.base_url, messages)
            if llama is not None:
                row["llama_s"], row["llama_prompt_n"] = llama_ttft(llama.url, prompts[turn], True)
                if row["restart"]:
                    row["llama_restore_s"] = restore_s
            if llama_cold is not None:
                row["llama_cold_s"], _ = llama_ttft(llama_cold[1], prompts[turn], False)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        warm.stop()
        if cold is not None:
            cold.stop()
        if llama is not None:
            llama.process.kill()
        if llama_cold is not None:
            llama_cold[0].kill()
    print_table(rows)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


def print_table(rows: list[dict]) -> None:
    columns = [
        ("turn", lambda r: f"{r['turn']}" + (" (after restart)" if r["restart"] else "")),
        ("prompt tokens", lambda r: str(r["prompt_tokens"])),
        ("cached", lambda r: str(r["cached_tokens"])),
        ("Deltafin TTFT", lambda r: f"{r['deltafin_s'] * 1000:.0f} ms"),
    ]
    if "cold_s" in rows[0]:
        columns += [
            ("cold prefill TTFT", lambda r: f"{r['cold_s']:.2f} s"),
            ("Deltafin / cold", lambda r: f"**{r['deltafin_s'] / r['cold_s']:.3f}x**"),
        ]
    if "llama_s" in rows[0]:
        columns += [
            (
                "llama-server slot cache TTFT (prompt tokens it ran)",
                lambda r: (
                    f"{r['llama_s'] * 1000:.0f} ms ({r['llama_prompt_n']})"
                    + (f" + {r['llama_restore_s'] * 1000:.0f} ms restore" if r.get("llama_restore_s") else "")
                ),
            ),
            ("Deltafin / llama-server", lambda r: f"{r['deltafin_s'] / r['llama_s']:.2f}x"),
        ]
    if "llama_cold_s" in rows[0]:
        columns += [
            ("llama-server cold", lambda r: f"{r['llama_cold_s']:.2f} s"),
            ("llama-server / its cold", lambda r: f"{r['llama_s'] / r['llama_cold_s']:.3f}x"),
        ]
    print("| " + " | ".join(name for name, _ in columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(cell(row) for _, cell in columns) + " |")


if __name__ == "__main__":
    main()
