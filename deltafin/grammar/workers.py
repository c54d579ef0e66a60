"""Lanes of grammar worker processes (`deltafin.grammar.worker`), each driven by a thread of this process.

Work is queued FIFO; each lane takes the next request, sends it to its worker and waits for the answer at
most `timeout_s`. A worker that overruns is killed and replaced (never left burning a core); one that dies
is replaced. The lane thread also turns the answer into what the caller wants (`decode`: compiling the grammar
the worker proved; xgrammar releases the GIL there), so neither the event loop nor the engine's owner thread
ever runs grammar work. A request whose future was cancelled while queued (nobody waits for it any
more) is skipped.

Workers are forked from multiprocessing's fork server, which imports xgrammar (and torch, which xgrammar
imports) once; the workers share those pages.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import structlog

from deltafin.grammar import worker as worker_module
from deltafin.grammar.limits import TooComplex

log = structlog.get_logger("deltafin.grammar")

#: how long a new worker may take to import, deserialize the tokenizer info and warm up
START_TIMEOUT_S = 120.0


def fork_server() -> Any:
    """multiprocessing's fork-server context, its server started (importing xgrammar) if it is not yet: started
    early, on a thread of its own, this overlaps the model's load instead of following it."""
    context = multiprocessing.get_context("forkserver")
    # Effective only when this process starts the fork server (the first caller does).
    context.set_forkserver_preload([worker_module.__name__])
    multiprocessing.forkserver.ensure_running()  # locked: concurrent callers wait for the one start
    return context


class CompileTimeout(TooComplex):
    """The compile ran past the time budget; the worker was killed."""


class WorkerFailed(ValueError):
    """The worker died on the request (xgrammar crashed on it) or could not start."""


@dataclass(eq=False)
class _Request:
    payload: bytes
    decode: Callable[[bytes], Any]
    future: Future = field(default_factory=Future)
    #: monotonic time a lane took it (None while queued)
    started: float | None = None


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, context: Any, tokenizer_info: bytes, timeout_s: float) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=worker_module.serve, args=(child, timeout_s), daemon=True, name="deltafin-grammar"
        )
        self.process.start()
        child.close()
        self.conn.send_bytes(tokenizer_info)
        if not self.conn.poll(START_TIMEOUT_S) or self.conn.recv_bytes() != worker_module.READY:
            self.stop()
            raise WorkerFailed("the grammar worker did not start")

    def ask(self, payload: bytes, timeout_s: float) -> bytes:
        self.conn.send_bytes(payload)
        if not self.conn.poll(timeout_s):
            raise CompileTimeout(f"compiling it took longer than {timeout_s:g} s")
        return self.conn.recv_bytes()

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


class CompileWorkers:
    def __init__(self, tokenizer_info: bytes, *, workers: int, timeout_s: float) -> None:
        """tokenizer_info: `TokenizerInfo.serialize_json()` as bytes, or b"" for check-only workers."""
        self.timeout_s = timeout_s
        self._tokenizer_info = tokenizer_info
        self._context = fork_server()
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self.replaced = 0  # workers killed or lost and started again (tests read it)
        self.sent = 0  # requests that reached a worker (tests read it)
        #: each lane's current worker (None while a replacement could not start)
        self._workers: list[_Worker | None] = [self._start_worker_or_fail() for _ in range(max(1, workers))]
        self._lanes = [
            threading.Thread(target=self._lane, args=(i,), name=f"deltafin-grammar-{i}", daemon=True)
            for i in range(len(self._workers))
        ]
        for lane in self._lanes:
            lane.start()

    def submit(self, payload: bytes, decode: Callable[[bytes], Any]) -> _Request:
        """Queue `payload` for a worker; the request's future gets `decode(answer)` or the exception. Cancel
        the future while the request is queued and it is never sent."""
        request = _Request(payload, decode)
        self._queue.put(request)
        return request

    def close(self) -> None:
        for _ in self._lanes:
            self._queue.put(None)

    def pids(self) -> list[int]:
        """The worker processes' ids (tests check that a killed one is gone)."""
        return [w.process.pid for w in self._workers if w is not None]

    def _start_worker_or_fail(self) -> _Worker:
        return _Worker(self._context, self._tokenizer_info, self.timeout_s)

    def _lane(self, lane: int) -> None:
        while True:
            request = self._queue.get()
            current = self._workers[lane]
            if request is None:
                if current is not None:
                    current.stop()
                return
            if not request.future.set_running_or_notify_cancel():
                continue  # its requesters left while it was queued
            request.started = time.monotonic()
            try:
                if current is None:  # the last replacement failed to start: try again for this request
                    current = self._workers[lane] = self._start_worker_or_fail()
                self.sent += 1
                answer = current.ask(request.payload, self.timeout_s)
            except CompileTimeout as exc:
                log.warning("grammar_compile_timeout", timeout_s=self.timeout_s)
                request.future.set_exception(exc)  # answered first; the lane then replaces its worker
                self._workers[lane] = self._replace(current)
                continue
            except (EOFError, OSError, WorkerFailed) as exc:
                log.warning("grammar_worker_lost", error=type(exc).__name__)
                request.future.set_exception(WorkerFailed("the grammar compiler failed on it"))
                self._workers[lane] = self._replace(current)
                continue
            try:
                request.future.set_result(request.decode(answer))
            except Exception as exc:  # a ValueError from decode is the request's answer; anything else too
                request.future.set_exception(exc)

    def _replace(self, worker: _Worker | None) -> _Worker | None:
        if worker is not None:
            worker.stop()
        self.replaced += 1
        try:
            return self._start_worker_or_fail()
        except Exception:  # retried at the next request; that request fails if it cannot start either
            log.exception("grammar_worker_start_failed")
            return None
