"""Constraint -> a grammar ready for the engine, prepared off the event loop and the engine's owner thread.

`Grammars.prepare(constraint)` answers from a cache of outcomes, or has a worker process prove it (limits,
xgrammar's reading of it and a trial compile, all within the time budget: `deltafin.grammar.worker_process`) and then
compiles the proven grammar on the lane's thread, while the request waits in its own lane, before it asks the
engine for room: rows already decoding never wait for a grammar, and the engine receives it compiled
(`GenerationJob.grammar`).

- Outcomes are cached both ways: a compiled grammar (LRU of `entries`, at most `cache_bytes` together) and a
  refusal (LRU of `failures`), so a schema that failed, or ran past the time budget, is answered again in
  microseconds however often it is sent.
- Requests for a constraint being compiled share that compile; compiles wait in their API key's turn
  (`owner`: deltafin.grammar.lanes.FairQueue).
- A worker lost on a constraint (killed from outside, crashed) is `WorkerLost`, not cached: the server's failure,
  worth a retry. A constraint on which a worker dies twice in a row is refused like an invalid one, and cached.
- A request that cannot get a worker by its deadline is refused (429) and its queued compile dropped if nobody
  else waits for it; a compile that started runs to its end or its budget, and its outcome is cached.
- Check-only (no tokenizer info: a gateway, whose upstream compiles): the worker runs the limits and xgrammar's
  schema conversion, so a bad or hostile constraint is refused here; `prepare` then returns None.
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from deltafin.errors import EngineBusyError
from deltafin.grammar import worker_process as worker_module
from deltafin.grammar.compiled import ReadyGrammar
from deltafin.grammar.lanes import CompileWorkers, WorkerLost
from deltafin.grammar.limits import TooComplex
from deltafin.protocol.sampling import Constraint


@dataclass(eq=False)
class _Pending:
    request: Any  # workers._Request
    waiters: int = 0


class Grammars:
    def __init__(
        self,
        info: xgr.TokenizerInfo | None,
        vocab_size: int,
        *,
        workers: int = 1,
        timeout_s: float = 10.0,
        entries: int = 64,
        cache_bytes: int = 512 * 2**20,
        failures: int = 1024,
        retry_after_s: float = 30.0,
    ) -> None:
        """info: the engine's tokenizer info (compile for it), or None (check only)."""
        self._info = info
        # Each lane thread compiles with a compiler of its own (made on its first proven grammar).
        self._compilers = threading.local()
        self._cache_bytes = cache_bytes
        self._held_bytes = 0
        self._vocab_size = vocab_size
        self._entries = entries
        self._failures = failures
        self._retry_after = str(max(1, math.ceil(retry_after_s)))
        self.timeout_s = timeout_s
        self._pool = CompileWorkers(
            info.serialize_json().encode("utf-8") if info is not None else b"", workers=workers, timeout_s=timeout_s
        )
        self._ready: OrderedDict[Constraint, ReadyGrammar | None] = OrderedDict()
        self._refused: OrderedDict[Constraint, ValueError] = OrderedDict()
        self._inflight: dict[Constraint, _Pending] = {}
        self._deaths: OrderedDict[Constraint, int] = OrderedDict()  # workers lost in a row on a constraint
        self._lock = threading.Lock()  # the lanes settle outcomes on their threads
        self.compiles = 0  # compiles that reached a worker (tests and the bench read it)

    @property
    def workers(self) -> CompileWorkers:
        return self._pool

    async def prepare(
        self, constraint: Constraint, *, deadline: float | None = None, owner: str = ""
    ) -> tuple[ReadyGrammar | None, float]:
        """(the ready grammar, or None when checking only; seconds this request's compile ran). Raises
        ValueError (TooComplex when over a limit or the time budget) for a constraint that cannot be enforced,
        EngineBusyError when no worker took it by `deadline` (monotonic), WorkerLost when its worker died.
        `owner` (the API key's digest) is whose turn the compile waits for."""
        with self._lock:
            if constraint in self._ready:
                self._ready.move_to_end(constraint)
                return self._ready[constraint], 0.0
            refused = self._refused.get(constraint)
            if refused is not None:
                raise type(refused)(str(refused))
            pending = self._inflight.get(constraint)
            if pending is None:
                request = self._pool.submit(worker_module.encode_request(constraint), self._decode, owner)
                pending = self._inflight[constraint] = _Pending(request)
                self.compiles += 1
                request.future.add_done_callback(functools.partial(self._settle, constraint, pending))
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
            try:
                ready = await asyncio.shield(outcome)
            except WorkerLost:
                refused = self._refused.get(constraint)  # lost twice in a row: settled as the constraint's fault
                if refused is not None:
                    raise type(refused)(str(refused)) from None
                raise
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
        """The worker's answer -> the grammar compiled here (the same compile the worker just finished within
        the budget and the size limit), or the refusal."""
        status, payload = answer[:1], answer[1:]
        if status != worker_module.OK:
            reason = payload.decode("utf-8", "replace")
            raise TooComplex(reason) if status == worker_module.TOO_COMPLEX else ValueError(reason)
        if self._info is None:
            return None
        compiler = getattr(self._compilers, "compiler", None)
        if compiler is None:
            compiler = self._compilers.compiler = worker_module.make_compiler(self._info)
        grammar = xgr.Grammar.deserialize_json(payload.decode("utf-8"))
        return ReadyGrammar(worker_module.compile_grammar(compiler, grammar), self._vocab_size)

    def _settle(self, constraint: Constraint, pending: _Pending, done: Future) -> None:
        with self._lock:
            if self._inflight.get(constraint) is pending:
                del self._inflight[constraint]
            if done.cancelled():
                return
            error = done.exception()
            if not isinstance(error, WorkerLost):
                self._deaths.pop(constraint, None)
            if error is None:
                ready = done.result()
                self._ready[constraint] = ready
                self._held_bytes += _size(ready)
                while len(self._ready) > self._entries or (
                    self._held_bytes > self._cache_bytes and len(self._ready) > 1
                ):
                    self._held_bytes -= _size(self._ready.popitem(last=False)[1])
            elif isinstance(error, ValueError):
                self._refuse(constraint, error)
            elif isinstance(error, WorkerLost):
                # Not cached at first: the worker may have been killed from outside, or run out of memory. Twice
                # in a row on the same constraint is the constraint's doing (xgrammar crashes on it).
                deaths = self._deaths.pop(constraint, 0) + 1
                if deaths >= 2:
                    self._refuse(constraint, ValueError("the grammar compiler failed on it twice"))
                else:
                    self._deaths[constraint] = deaths
                    while len(self._deaths) > self._failures:
                        self._deaths.popitem(last=False)

    def _refuse(self, constraint: Constraint, error: ValueError) -> None:
        self._refused[constraint] = error
        while len(self._refused) > self._failures:
            self._refused.popitem(last=False)


def _size(ready: ReadyGrammar | None) -> int:
    return ready.compiled.memory_size_bytes if ready is not None else 0
