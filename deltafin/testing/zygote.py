"""Start test servers by forking one process that has already imported the server's code.

A server's start was ~11 s on 2 cores, most of it imports (torch, transformers, xgrammar, litestar,
Hydra) that are the same for every server of a test run. The zygote is a Python process running `serve()`: it
imports them once, then forks a child per server; the child runs `deltafin.cli.main(argv)` exactly as
`python -m deltafin argv` would (its own process, its own log file, signals and exit code), and
is ready in ~4 s (the model's load, and the grammar workers' fork server, a fresh interpreter of its own). Nothing else is shared: the zygote never runs torch or opens a model, so a child starts from
the same state a fresh interpreter reaches after its imports.

Forking is safe here because the zygote stays single-threaded: it only imports, reads requests from stdin and
reaps children (torch's thread pools and xgrammar's start lazily, in the child).

Protocol (one JSON object per line): the parent writes {"start": {argv, env, cwd, log}} -> {"pid"};
{"poll": pid} -> {"returncode": int | null}. The zygote reaps its children and remembers their exit codes,
since only it can wait for them.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

#: what a CPU server imports on its way to serving (deltafin.cli imports the rest lazily, in this order)
PRELOAD = (
    "deltafin.cli",
    "deltafin.families",
    "deltafin.rules",
    "deltafin.logging",
    "deltafin.app",
    "deltafin.app.server",
    "deltafin.engine.weights.loader",
    "deltafin.grammar.worker_process",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
)


class ForkedProcess:
    """The part of `subprocess.Popen`'s interface that tests use, for a child of the zygote."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]  # poll() set it before the loop ended

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The parent's handle on the zygote process (one per test run, started on first use)."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self._process = subprocess.Popen(
            # -c, not -m: multiprocessing's fork server (a server's grammar workers) re-imports a -m main module
            [sys.executable, "-c", "from deltafin.testing.zygote import serve; serve()"],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._lock = threading.Lock()  # tests start and poll servers from several threads
        if self._call({"ready": None}).get("ready") is not True:
            raise RuntimeError("the zygote did not start")

    def _call(self, request: dict) -> dict:
        with self._lock:
            assert self._process.stdin and self._process.stdout
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
            line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote exited ({self._process.poll()})")
        return json.loads(line)

    def start(self, argv: list[str], *, env: dict[str, str], cwd: Path, log: Path) -> ForkedProcess:
        reply = self._call({"start": {"argv": argv, "env": env, "cwd": str(cwd), "log": str(log)}})
        return ForkedProcess(self, reply["pid"])

    def returncode(self, pid: int) -> int | None:
        return self._call({"poll": pid})["returncode"]

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()  # type: ignore[union-attr]  # started with stdin=PIPE
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()


def _run_child(argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """In the forked child: become `python -m deltafin argv`, then exit with its code."""
    code = 1
    try:
        # The zygote's process group (the test run's), as a server started by Popen would be: Ctrl-C stops them all.
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = [sys.argv[0], *argv]
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from deltafin.cli import main

        main(argv)
        code = 0
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """The zygote's main loop (run by `Zygote`)."""
    import importlib

    sys.modules.setdefault("triton", None)  # type: ignore[arg-type]  # as deltafin.cli does on the CPU
    for name in PRELOAD:
        importlib.import_module(name)
    exited: dict[int, int] = {}
    children: set[int] = set()
    while True:
        while children:  # reap: only the zygote can wait for its children
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            exited[pid] = os.waitstatus_to_exitcode(status)
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            return
        request = json.loads(line)
        if "ready" in request:
            reply: dict = {"ready": True}
        elif "start" in request:
            spec = request["start"]
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _run_child(spec["argv"], spec["env"], spec["cwd"], spec["log"])
            children.add(pid)
            reply = {"pid": pid}
        else:
            pid = request["poll"]
            if pid in children:  # not reaped yet: maybe it has just exited
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    children.discard(pid)
                    exited[pid] = os.waitstatus_to_exitcode(status)
            reply = {"returncode": exited.get(pid)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
