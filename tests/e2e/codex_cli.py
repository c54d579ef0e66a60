"""Codex CLI (npm `@openai/codex`) for the tests: installed from the npm registry into a cache outside the
repository on first use (CI starts from a clean machine), and run as `codex exec` against a custom provider
that speaks the Responses API, with a CODEX_HOME of its own (no login, no user config)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

VERSION = "0.171.0"
CACHE = Path(os.environ.get("DELTAFIN_CACHE", Path.home() / ".cache" / "deltafin")) / f"codex-{VERSION}"


def codex_binary() -> Path:
    """The codex launcher, installed once (under a lock: test processes may ask at the same time)."""
    binary = CACHE / "node_modules" / ".bin" / "codex"
    if binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is needed to install Codex CLI (@openai/codex) for this test")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE.parent / f"codex-{VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            subprocess.run(
                [npm, "install", "--prefix", str(CACHE), "--no-audit", "--no-fund", f"@openai/codex@{VERSION}"],
                check=True,
                capture_output=True,
                timeout=600,
            )
    return binary


def codex_exec(
    base_url: str, model: str, prompt: str, home: Path, workdir: Path, timeout: float = 600
) -> subprocess.CompletedProcess:
    """One `codex exec` turn with Deltafin (or any Responses server at `base_url`) as its provider."""
    home.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "deltafin"\n\n[model_providers.deltafin]\nname = "Deltafin"\n'
        f'base_url = "{base_url}"\nwire_api = "responses"\nrequest_max_retries = 0\nstream_max_retries = 0\n'
        "stream_idle_timeout_ms = 600000\n"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OPENAI_", "CODEX_"))}
    env["CODEX_HOME"] = str(home)
    return subprocess.run(
        [str(codex_binary()), "exec", "--skip-git-repo-check", "--color", "never", prompt],
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
