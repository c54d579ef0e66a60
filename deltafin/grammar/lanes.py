"""Lanes of grammar worker processes (`deltafin.grammar.worker_process`), each driven by a thread of this process.

Work is queued per API key and the keys take turns (`FairQueue`): a key that queues a dozen slow schemas makes
another key's schema wait for one compile at most, not for all of them. Each lane takes the next request, sends
it to its worker and waits for the answer at most `timeout_s`. A worker that overruns is killed and replaced
(never left burning a core); one that dies (killed from outside, or crashed) is replaced, and its request gets
`WorkerLost`, a failure of the server's to retry, not the constraint's. The lane thread also turns the answer
into what the caller wants (`decode`: compiling the grammar the worker proved; xgrammar releases the GIL
there), so neither the event loop nor the engine's owner thread ever runs grammar work. A request whose future
was cancelled while queued (nobody waits for it any more) is skipped.

Decoding keeps its cores: by default there is one lane fewer than the machine has cores (`default_workers`),
and workers and lane threads run `WORKER_NICENESS` below the server's priority.

Workers are forked from multiprocessing's fork server, which imports xgrammar (and torch, which xgrammar
imports) once; the workers share those pages.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import structlog

from deltafin.grammar import worker_process as worker_module
from deltafin.grammar.failures import WorkerLost
from deltafin.grammar.limits import TooComplex
from deltafin.grammar.worker_process import WORKER_NICENESS

__all__ = ["WORKER_NICENESS", "CompileTimeout", "CompileWorkers", "FairQueue", "WorkerLost", "default_workers"]

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


def default_workers() -> int:
    """Grammar lanes when `server.grammar.workers` is not given: one fewer than the cores, at least one, so a
    core is left for decoding."""
    return max(1, (os.cpu_count() or 2) - 1)


class FairQueue:
    """Items queued per owner (an API key's digest), taken in fair turns (start-time fair queueing): each owner
    counts the items it was given; `get` serves the owner with work that was given the fewest, and an owner
    that had nothing queued joins at the count of the owner served last, so it goes next without being owed
    a burst. Thread-safe; `get` blocks."""

    def __init__(self) -> None:
        self._pending: dict[str, deque[Any]] = {}
        self._given: dict[str, int] = {}  # items each owner was given
        self._order: dict[str, tuple[int, int]] = {}  # ties: (when it was last served, when it joined)
        self._now = 0  # the count of the owner served last
        self._ticks = 0
        self._ready = threading.Condition()
        self._closed = 0  # lanes told to stop (each get after close returns None once)

    def put(self, owner: str, item: Any) -> None:
        with self._ready:
            if owner not in self._pending:
                self._pending[owner] = deque()
                self._given[owner] = max(self._given.get(owner, 0), self._now)
                self._order[owner] = (self._order.get(owner, (-1, 0))[0], self._tick())
            self._pending[owner].append(item)
            self._ready.notify()

    def close(self, getters: int) -> None:
        with self._ready:
            self._closed += getters
            self._ready.notify_all()

    def get(self) -> Any:
        with self._ready:
            while not self._pending and not self._closed:
                self._ready.wait()
            if not self._pending:
                self._closed -= 1
                return None
            owner = min(self._pending, key=lambda o: (self._given[o], *self._order[o]))
            items = self._pending[owner]
            item = items.popleft()
            if not items:
                del self._pending[owner]
            self._now = self._given[owner]
            self._given[owner] += 1
            self._order[owner] = (self._tick(), self._order[owner][1])
            return item

    def _tick(self) -> int:
        self._ticks += 1
        return self._ticks


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
            raise WorkerLost("the grammar worker did not start")

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
        self._queue = FairQueue()
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

    def submit(self, payload: bytes, decode: Callable[[bytes], Any], owner: str = "") -> _Request:
        """Queue `payload` for a worker, in `owner`'s turn; the request's future gets `decode(answer)` or the
        exception. Cancel the future while the request is queued and it is never sent."""
        request = _Request(payload, decode)
        self._queue.put(owner, request)
        return request

    def close(self) -> None:
        self._queue.close(len(self._lanes))

    def pids(self) -> list[int]:
        """The worker processes' ids (tests check that a killed one is gone)."""
        return [w.process.pid for w in self._workers if w is not None]

    def _start_worker_or_fail(self) -> _Worker:
        return _Worker(self._context, self._tokenizer_info, self.timeout_s)

    def _lane(self, lane: int) -> None:
        try:  # on Linux a thread's priority is its own: this lane's compiles yield to decoding as its worker does
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICENESS)
        except (OSError, AttributeError):
            pass
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
            except (EOFError, OSError, WorkerLost) as exc:
                log.warning("grammar_worker_lost", error=type(exc).__name__)
                request.future.set_exception(WorkerLost("the grammar worker was lost while compiling it"))
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
