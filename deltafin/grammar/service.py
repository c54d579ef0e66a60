"""Constraint -> a grammar ready for the engine, prepared off the event loop and the engine's owner thread.

`Grammars.prepare(constraint)` answers from a cache of outcomes, or has a worker process check and compile it
(`deltafin.grammar.workers`) while the request waits in its own lane, before it asks the engine for room: rows
already decoding never wait for a grammar, and the engine receives it compiled (`GenerationJob.grammar`).

- Outcomes are cached both ways: a compiled grammar (LRU of `entries`) and a refusal (LRU of `failures`), so a
  schema that failed, or ran past the time budget, is answered again in microseconds however often it is sent.
- Requests for a constraint being compiled share that compile.
- A request that cannot get a worker by its deadline is refused (429) and its queued compile dropped if nobody
  else waits for it; a compile that started runs to its end or its budget, and its outcome is cached.
- Check-only (no tokenizer info: a gateway, whose upstream compiles): the worker runs the limits and xgrammar's
  schema conversion, so a bad or hostile constraint is refused here; `prepare` then returns None.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from deltafin.errors import EngineBusyError
from deltafin.grammar import worker as worker_module
from deltafin.grammar.compiled import ReadyGrammar
from deltafin.grammar.limits import TooComplex
from deltafin.grammar.workers import CompileWorkers, WorkerFailed
from deltafin.protocol.sampling import Constraint


@dataclass(eq=False)
class _Pending:
    request: Any  # workers._Request
    waiters: int = 0


class Grammars:
    def __init__(self, info: xgr.TokenizerInfo | None, vocab_size: int, *, workers: int = 1, timeout_s: float = 10.0,
                 entries: int = 64, failures: int = 1024, retry_after_s: float = 30.0) -> None:
        """info: the engine's tokenizer info (compile for it), or None (check only)."""
        self._info = info
        self._vocab_size = vocab_size
        self._entries = entries
        self._failures = failures
        self._retry_after = str(max(1, math.ceil(retry_after_s)))
        self.timeout_s = timeout_s
        self._pool = CompileWorkers(info.serialize_json().encode("utf-8") if info is not None else b"",
                                    workers=workers, timeout_s=timeout_s)
        self._ready: OrderedDict[Constraint, ReadyGrammar | None] = OrderedDict()
        self._refused: OrderedDict[Constraint, ValueError] = OrderedDict()
        self._inflight: dict[Constraint, _Pending] = {}
        self._lock = threading.Lock()  # the lanes settle outcomes on their threads
        self.compiles = 0  # compiles that reached a worker (tests and the bench read it)

    @property
    def workers(self) -> CompileWorkers:
        return self._pool

    async def prepare(self, constraint: Constraint, *, deadline: float | None = None) -> tuple[ReadyGrammar | None, float]:
        """(the ready grammar, or None when checking only; seconds this request's compile ran). Raises
        ValueError (TooComplex when over a limit or the time budget) for a constraint that cannot be enforced,
        EngineBusyError when no worker took it by `deadline` (monotonic)."""
        with self._lock:
            if constraint in self._ready:
                self._ready.move_to_end(constraint)
                return self._ready[constraint], 0.0
            refused = self._refused.get(constraint)
            if refused is not None:
                raise type(refused)(str(refused))
            pending = self._inflight.get(constraint)
            if pending is None:
                request = self._pool.submit(worker_module.encode_request(constraint), self._decode)
                pending = self._inflight[constraint] = _Pending(request)
                self.compiles += 1
                request.future.add_done_callback(lambda done, mine=pending: self._settle(constraint, mine, done))
            pending.waiters += 1
        joined = time.monotonic()
        request = pending.request
        try:
            # One asyncio view per waiter, shielded: a waiter that leaves must not cancel the shared compile.
            outcome = asyncio.wrap_future(request.future)
            if deadline is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(outcome), timeout=max(0.0, deadline - joined))
                except TimeoutError:
                    if request.started is None:  # still queued behind other compiles
                        raise EngineBusyError(
                            f"The server is busy (no grammar worker free in time); retry after {self._retry_after} s.",
                            headers={"Retry-After": self._retry_after},
                        ) from None
            ready = await asyncio.shield(outcome)
            return ready, time.monotonic() - max(joined, request.started or joined)
        finally:
            with self._lock:
                pending.waiters -= 1
                abandoned = pending.waiters == 0 and request.started is None
                if abandoned and self._inflight.get(constraint) is pending:
                    del self._inflight[constraint]  # a request arriving from now on queues a compile of its own
            if abandoned:  # nobody waits: a queued compile is dropped (its done callback takes the lock)
                request.future.cancel()

    def close(self) -> None:
        self._pool.close()

    # On a lane thread.

    def _decode(self, answer: bytes) -> ReadyGrammar | None:
        status, payload = answer[:1], answer[1:]
        if status == worker_module.OK:
            if self._info is None:
                return None
            return ReadyGrammar(xgr.CompiledGrammar.deserialize_json(payload.decode("utf-8"), self._info), self._vocab_size)
        reason = payload.decode("utf-8", "replace")
        raise TooComplex(reason) if status == worker_module.TOO_COMPLEX else ValueError(reason)

    def _settle(self, constraint: Constraint, pending: _Pending, done: Future) -> None:
        with self._lock:
            if self._inflight.get(constraint) is pending:
                del self._inflight[constraint]
            if done.cancelled():
                return
            error = done.exception()
            if error is None:
                self._ready[constraint] = done.result()
                while len(self._ready) > self._entries:
                    self._ready.popitem(last=False)
            elif isinstance(error, ValueError) and not isinstance(error, WorkerFailed):
                # A crash is not cached: it may have been the worker's (out of memory), not the constraint's.
                self._refused[constraint] = error
                while len(self._refused) > self._failures:
                    self._refused.popitem(last=False)
