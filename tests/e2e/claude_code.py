"""Claude Code (npm `@anthropic-ai/claude-code`, installed by scripts/install-claude-code) for the tests and the
benchmark: where its binary is, and one `claude -p` turn against a Messages server, offline (the environment
Claude Code needs to send nothing but its requests to that server), with a HOME of its own."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

VERSION = "2.1.332"
#: where scripts/install-claude-code puts it (scripts/test exports DELTAFIN_CLAUDE_CODE with the same path)
CACHED = Path(os.environ.get("DELTAFIN_CACHE", Path.home() / ".cache" / "deltafin")) / f"claude-code-{VERSION}"


def claude_code_binary() -> Path:
    return Path(os.environ.get("DELTAFIN_CLAUDE_CODE") or CACHED / "node_modules" / ".bin" / "claude")


def claude_env(base_url: str, home: Path, **extra: str) -> dict[str, str]:
    """Claude Code's environment for a Messages server at `base_url` (no /v1): the key goes out as x-api-key;
    no telemetry, update check or error report, and no probe of the base URL (`HEAD /api/hello`)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update(
        HOME=str(home),
        ANTHROPIC_BASE_URL=base_url,
        ANTHROPIC_API_KEY="unused",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_ERROR_REPORTING="1",
        **extra,
    )
    return env


def claude_print(
    base_url: str, prompt: str, home: Path, *args: str, timeout: float = 600, **env: str
) -> subprocess.CompletedProcess:
    """`claude -p PROMPT --output-format json ARGS` run in `home` (its working folder too)."""
    home.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [str(claude_code_binary()), "-p", prompt, "--output-format", "json", *args],
        cwd=home,
        env=claude_env(base_url, home, **env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
