"""`UpstreamEngine`: an `EngineClient` whose tokens come from another server over HTTP.

Deltafin renders and tokenizes, sends token ids, and runs its own detokenizer and stop matcher on the ids that
come back (`ChoiceDecoder`); the adapter (`vllm`, `sglang`, `llama_server`) only knows its wire protocol.
Every choice streams from the upstream, even for a non-streamed client request, so a client that leaves
closes the upstream request at once (and the adapter's abort endpoint is called where there is one).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
import time
import uuid
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import msgspec
import structlog

from deltafin.engine.events import FinishReason, GenerationJob, TextDelta
from deltafin.engine.interface import EngineCapabilities, EngineClient, Readiness
from deltafin.engine.stream import GenerationStream
from deltafin.engine.text.choice_decoder import ChoiceDecoder
from deltafin.engine.timeline import Mark, Timeline, now_ns
from deltafin.engine.upstream.budget import BudgetWatch
from deltafin.engine.upstream.health import UpstreamHealth
from deltafin.engine.upstream.http1 import (
    ConnectFailed,
    Connector,
    Exchange,
    Http1Pool,
    ReadTimedOut,
    Response,
    TransportError,
)
from deltafin.engine.upstream.wire import (
    Chunk,
    Garbled,
    Target,
    error_for_status,
    error_in_stream,
    sse_batches,
)
from deltafin.engine.weights.tokenizer_only import TokenizerBundle
from deltafin.errors import DeltafinError, UpstreamError, UpstreamTimeoutError, UpstreamUnavailableError

log = structlog.get_logger("deltafin.upstream")
_encode = msgspec.json.Encoder().encode

#: the longest a health probe waits for the upstream's answer (less when engine.connect_timeout_s is less)
HEALTH_PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class UpstreamSettings:
    url: str
    max_inflight: int = 64
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    retry_after_s: int = 2
    #: connections kept open ahead of need (llama-server closes each streamed one; 0: connect on demand)
    spare_connections: int = 1
    #: the `model` field sent upstream (None: left out, the upstream serves its only model)
    model: str | None = None
    api_key: str | None = None


#: statuses of a generation request that say the upstream as a whole is not there or not ready
_DOWN_STATUSES = frozenset({502, 503, 504})


class UpstreamObserver(Protocol):
    """Where upstream latency and errors go (the app's metrics)."""

    def upstream_latency(self, engine: str, seconds: float) -> None: ...

    def upstream_error(self, engine: str, kind: str) -> None: ...


class Adapter(ABC):
    """One upstream's wire protocol: the request for a job, and the meaning of each stream event."""

    engine: str
    health_path = "/health"
    capabilities = EngineCapabilities(prompt_logprobs=False, grammar=True, cached_tokens=True)

    def __init__(self, settings: UpstreamSettings) -> None:
        self.settings = settings

    @abstractmethod
    def request(self, job: GenerationJob, request_id: str, stop_ids: frozenset[int]) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) of a streamed generation of `job`."""

    def new_state(self, job: GenerationJob) -> Any:
        """Per-choice parsing state (SGLang's cumulative streams need to know what was already seen)."""
        return None

    @abstractmethod
    def parse(self, payload: Any, state: Any) -> Chunk:
        """One decoded stream event; raise `Garbled` when it is not what the protocol promises."""

    def fallback(self, status: int, path: str, body: bytes) -> bool:
        """After `status` (and `body`) from a request sent to `path`, retry it on the adapter's current endpoint
        (True: the adapter has switched, now or for an earlier request) or fail it (False)."""
        return False

    def abort(self, request_id: str) -> tuple[str, dict[str, Any]] | None:
        """(path, body) that frees the request upstream, where closing the connection is not enough."""
        return None


class UpstreamEngine(EngineClient):
    def __init__(
        self,
        adapter: Adapter,
        bundle: TokenizerBundle,
        *,
        connect: Connector | None = None,
        observer: UpstreamObserver | None = None,
    ) -> None:
        self.adapter = adapter
        self.settings = adapter.settings
        self.name = adapter.engine
        self.tokenizer = bundle.tokenizer
        self.context_length = bundle.context_length
        self.stop_token_ids = bundle.stop_token_ids
        self.vocab_size = bundle.vocab_size
        self.capacity = self.settings.max_inflight
        self.capabilities = adapter.capabilities
        self.observer = observer
        self.target = Target(self.name, self.settings.url.rstrip("/"), self.settings.retry_after_s)
        self._connect = connect
        self._pool: tuple[asyncio.AbstractEventLoop, Http1Pool] | None = None
        self._started: weakref.WeakKeyDictionary[GenerationStream, asyncio.Future[None]] = weakref.WeakKeyDictionary()
        self._tasks: set[asyncio.Task[None]] = set()
        # /health follows traffic and an idle probe; a load balancer polling it never becomes upstream load.
        self.health = UpstreamHealth(self._probe_health, self.name)
        # Upstream request ids (abort endpoints name them): unique across gateways sharing an upstream by a
        # random prefix, and within this one by a counter (no random bytes read per request).
        prefix = uuid.uuid4().hex
        self._request_ids = (f"{prefix}-{n}" for n in itertools.count())

    # -- the EngineClient contract ------------------------------------------------------------------------

    def submit(self, jobs: Sequence[GenerationJob], stream: GenerationStream) -> None:
        loop = asyncio.get_running_loop()
        self._started[stream] = gate = loop.create_future()
        submission = _Submission(self, jobs, stream, _Gate(gate, len(jobs)), self._request_ids)
        # Tells the submission, on our loop, when the client leaves (`stream.close()`, on any thread), so the
        # choices stop at once instead of noticing at their next event.
        stream.cancelled.on_set(_on_loop(loop, submission.client_left))
        submission.start()

    async def started(self, stream: GenerationStream) -> None:
        """Wait for every choice's first upstream event, so errors known before then become HTTP statuses."""
        gate = self._started.pop(stream, None)
        if gate is not None:
            await gate

    async def readiness(self) -> Readiness:
        return await self.health.readiness()

    async def _probe_health(self) -> Readiness:
        path = self.adapter.health_path
        timeout_s = min(self.settings.connect_timeout_s, HEALTH_PROBE_TIMEOUT_S)
        try:
            async with asyncio.timeout(timeout_s + 0.5):  # connect and read are bounded by the pool; this is the sum
                async with self.pool.request("GET", path, read_timeout_s=timeout_s) as response:
                    await response.read_all()
            return Readiness(response.status == 200, f"{self.target} answered {response.status} on {path}")
        except (ReadTimedOut, TimeoutError):
            return Readiness(False, f"{self.target} did not answer {path} within {timeout_s:g} s")
        except TransportError as exc:
            return Readiness(False, f"{self.target} is unreachable: {type(exc).__name__}")

    async def aclose(self) -> None:
        self.health.close()
        for task in list(self._tasks):
            task.cancel()
        if self._pool is not None:
            self._pool[1].close()

    # -- one submission -------------------------------------------------------------------------------------

    @property
    def pool(self) -> Http1Pool:
        """Keep-alive connections, one pool per event loop (connections cannot move between loops)."""
        loop = asyncio.get_running_loop()
        if self._pool is None or self._pool[0] is not loop:
            s = self.settings
            headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
            # Idle connections for every generation in flight, plus the health check and aborts.
            self._pool = (
                loop,
                Http1Pool(
                    self.target.url,
                    max_idle=s.max_inflight + 2,
                    headers=headers,
                    connect=self._connect,
                    connect_timeout_s=s.connect_timeout_s,
                    read_timeout_s=s.read_timeout_s,
                    spare=s.spare_connections,
                ),
            )
        return self._pool[1]

    async def _stop(self, pending: set[asyncio.Task[None]], rids: list[str], tasks: list[asyncio.Task[None]]) -> None:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task, rid in zip(tasks, rids):
            if task in pending:
                await self._abort(rid)

    async def _abort(self, rid: str) -> None:
        call = self.adapter.abort(rid)
        if call is None:
            return
        path, body = call
        try:
            async with self.pool.request(
                "POST", path, _encode(body), read_timeout_s=self.settings.connect_timeout_s
            ) as response:
                await response.read_all()
        except TransportError as exc:  # the connection is closed anyway; the upstream notices in time
            log.warning("upstream_abort_failed", engine=self.name, error=type(exc).__name__)

    def _send(self, job: GenerationJob, choice: int, rid: str, stream: GenerationStream) -> Exchange:
        """The upstream request of one choice; written at once when a connection is idle (`Http1Pool.request`)."""
        # The client's request id travels upstream, so one grep finds both log lines.
        request_id = stream.log_context.get("request_id")
        headers = {"x-request-id": f"{request_id}-{choice}" if choice else str(request_id)} if request_id else {}
        if stream.timeline is not None:  # a traced request: the upstream continues the trace under this call
            headers.update(stream.timeline.call(choice).headers)
        path, body = self.adapter.request(job, rid, self._stop_ids(job))
        return self.pool.request("POST", path, _encode(body), headers)

    def _stop_ids(self, job: GenerationJob) -> frozenset[int]:
        """The ids the choice stops at, upstream and in Deltafin's decoder alike (`ignore_eos`: none, as the
        local engine runs it to max_tokens; sent upstream as given, vLLM would stop at an EOS in this list)."""
        if job.params.ignore_eos:
            return frozenset()
        return self.stop_token_ids | frozenset(job.params.stop_token_ids)

    async def _choice(
        self,
        job: GenerationJob,
        choice: int,
        rids: list[str],
        stream: GenerationStream,
        gate: _Gate,
        exchange: Exchange | BaseException,
    ) -> None:
        """`rids`: the submission's upstream request ids, one a choice (the current one, for an abort)."""
        started = time.perf_counter()
        timeline = stream.timeline
        if timeline is None:
            await self._run_choice(job, choice, rids, stream, gate, started, exchange)
            return
        began_ns = now_ns()
        try:
            await self._run_choice(job, choice, rids, stream, gate, started, exchange)
        except BaseException as exc:
            timeline.call(choice).attributes["error.type"] = type(exc).__name__
            raise
        finally:
            self._mark_call(timeline, choice, began_ns, exchange)

    def _mark_call(self, timeline: Timeline, choice: int, began_ns: int, exchange: Exchange | BaseException) -> None:
        """A traced choice's upstream call (resends included), as a client span under the request, with the id
        its traceparent named."""
        call = timeline.call(choice)
        path = exchange.path if isinstance(exchange, Exchange) else ""
        attributes = {
            "http.request.method": "POST",
            "url.full": self.target.url + path,
            "deltafin.upstream.engine": self.name,
            "deltafin.choice": choice,
            **call.attributes,
        }
        timeline.add(Mark(f"POST {path}", began_ns, now_ns(), attributes, span_id=call.span_id, kind="client"))

    async def _run_choice(
        self,
        job: GenerationJob,
        choice: int,
        rids: list[str],
        stream: GenerationStream,
        gate: _Gate,
        started: float,
        exchange: Exchange | BaseException,
    ) -> None:
        try:
            if isinstance(exchange, BaseException):  # building the request failed on the request's task
                raise exchange
            await self._stream_choice(job, choice, rids, stream, gate, started, exchange)
        except DeltafinError as exc:
            self._count_error(exc.code or type(exc).__name__)
            raise
        except ConnectFailed as exc:
            self._count_error("unreachable")
            self.health.unavailable(f"{self.target} is unreachable: {exc}")
            raise UpstreamUnavailableError(
                f"The upstream {self.target} is unreachable ({exc}).",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            ) from None
        except ReadTimedOut:
            self._count_error("timeout")
            self.health.unavailable(f"{self.target} sent nothing for {self.settings.read_timeout_s:g} s")
            raise UpstreamTimeoutError(
                f"The upstream {self.target} timed out (nothing for {self.settings.read_timeout_s:g} s)."
            ) from None
        except TransportError as exc:  # the connection broke mid-stream
            self._count_error("disconnected")
            self.health.unavailable(f"{self.target} closed a stream ({exc})")
            raise UpstreamError(f"The upstream {self.target} closed the stream ({exc}).") from None

    async def _stream_choice(
        self,
        job: GenerationJob,
        choice: int,
        rids: list[str],
        stream: GenerationStream,
        gate: _Gate,
        started: float,
        exchange: Exchange,
    ) -> None:
        prompt_len = len(job.prompt_ids)
        run = _ChoiceRun(
            ChoiceDecoder(self.tokenizer, job.params, self._stop_ids(job), choice), BudgetWatch(job, self.tokenizer)
        )
        fallbacks, resent = 0, False
        while True:
            try:
                async with exchange as response:
                    if stream.timeline is not None:
                        stream.timeline.call(choice).attributes["http.response.status_code"] = response.status
                    if response.status in _DOWN_STATUSES:
                        self.health.unavailable(f"{self.target} answered {response.status} to a generation")
                    elif response.status == 200:
                        self.health.available()
                    if response.status != 200:
                        raw = await response.read_all()
                        # an endpoint switch, then a field the upstream refuses (vLLM's thinking budget): each once
                        if fallbacks < 2 and self.adapter.fallback(response.status, exchange.path, raw):
                            fallbacks += 1
                            exchange = self._send(job, choice, rids[choice], stream)  # the adapter switched
                            continue
                        raise error_for_status(
                            self.target,
                            response.status,
                            raw,
                            response.headers,
                            context_length=self.context_length,
                            prompt_tokens=prompt_len,
                        )
                    try:
                        resumed = await self._read(
                            response, job, stream, gate, started, self._stop_ids(job), run, exchange.path
                        )
                    except _Refused:
                        if fallbacks >= 2:
                            raise UpstreamError(f"The upstream {self.target} refused the request twice.") from None
                        fallbacks += 1
                        exchange = self._send(job, choice, rids[choice], stream)
                        continue
                if resumed is None:
                    return
                # The thinking budget stopped the choice: it goes on in a new request, the end of reasoning forced.
                job, rids[choice] = resumed, f"{rids[choice].split('~')[0]}~{run.resumes}"
                exchange = self._send(job, choice, rids[choice], stream)
                fallbacks, resent = 0, False
            except _Unanswered as exc:
                if resent:
                    raise exc.cause from None
                # The upstream broke the stream before its first event: no token of this choice has reached
                # anyone, so it is sent once more. Behind a router that is another replica (the router itself
                # cannot retry a response whose head it has passed on); a dead single upstream refuses the
                # connect, which is a 503 + Retry-After.
                resent = True
                log.warning(
                    "upstream_resend", engine=self.name, upstream=self.target.url, choice=choice, error=str(exc.cause)
                )
                exchange = self._send(job, choice, rids[choice], stream)

    async def _read(
        self,
        response: Response,
        job: GenerationJob,
        stream: GenerationStream,
        gate: _Gate,
        started: float,
        stop_ids: frozenset[int],
        run: _ChoiceRun,
        response_path: str,
    ) -> GenerationJob | None:
        """One upstream request of a choice, read to its end (the choice's Finished sent: None), or to where the
        thinking budget stops it (the job that resumes it)."""
        decoder, first = run.decoder, run.resumes == 0
        state = self.adapter.new_state(job)
        finish: Chunk | None = None
        prompt_tokens, cached = (len(job.prompt_ids), 0) if first else (run.prompt_tokens, run.cached)
        stopped = overran = taken = False
        received = False  # once anything of the stream came, a failure is never sent again
        try:
            async for batch in sse_batches(response):
                received = True
                deltas: list[TextDelta] = []
                for payload in batch:
                    chunk = self.adapter.parse(payload, state)
                    if chunk.error is not None:
                        if not taken and self.adapter.fallback(400, response_path, chunk.error.encode()):
                            raise _Refused  # refused before any token (vLLM's generate endpoint does so in a 200)
                        _emit(stream, deltas)
                        raise error_in_stream(
                            self.target,
                            chunk.error,
                            context_length=self.context_length,
                            prompt_tokens=len(job.prompt_ids),
                        )
                    if first:  # the request's own prompt and cache; a resumed one's are the choice's own work
                        gate.arrived()
                        if chunk.prompt_tokens is not None:
                            prompt_tokens = chunk.prompt_tokens
                        if chunk.cached_tokens is not None:
                            cached = chunk.cached_tokens
                    if chunk.token_ids and run.first_token_s is None:
                        run.first_token_s = time.perf_counter() - started
                    for token_id, logprob in _aligned(chunk):
                        if not run.watch.keeps(token_id):
                            overran = True  # a reasoning token past the budget: not taken
                            break
                        taken = True
                        delta = decoder.push(token_id, logprob)
                        if delta is not None:
                            deltas.append(delta)
                    if overran:
                        break
                    if chunk.finish_reason is not None:
                        if chunk.finish_reason not in ("stop", "length"):  # vLLM's "abort" (preempted, shut down ...)
                            _emit(stream, deltas)
                            raise UpstreamError(
                                f"The upstream {self.target} ended the generation: {chunk.finish_reason}."
                            )
                        finish = chunk
                    elif decoder.done:
                        stopped = True  # Deltafin stopped (a stop string, a stop id the upstream does not know)
                        break
                if overran:
                    forced, resumed = run.watch.force_end(decoder)
                    _emit(stream, [*deltas, *forced])
                    run.prompt_tokens, run.cached, run.resumes = prompt_tokens, cached, run.resumes + 1
                    if resumed is not None:
                        return resumed  # leaving the `async with` closes this upstream request
                    break  # the forced end used the last of max_tokens
                _emit(stream, deltas)  # events that arrived together leave together: one wake-up of the client side
                if stopped:
                    break  # leaving the `async with` closes the upstream request
        except ReadTimedOut:
            raise  # a silent upstream may still be working on it
        except TransportError as exc:
            if received:
                raise
            raise _Unanswered(exc) from None
        if finish is None and not decoder.done and not overran:
            cut = Garbled(f"The upstream {self.target} ended the stream before the generation finished.")
            raise cut if received else _Unanswered(cut)
        total = time.perf_counter() - started
        if self.observer is not None:
            self.observer.upstream_latency(self.name, total)
        timings = {"total_s": total}
        if run.first_token_s is not None:
            timings["prefill_s"] = run.first_token_s  # the upstream's queue + prefill, as seen from here
        # "stop" or "length" (checked above); a choice whose forced end used up max_tokens ends at its length
        reason = cast(
            FinishReason | None, finish.finish_reason if finish is not None else "length" if overran else None
        )
        tail, finished = decoder.finish(
            reason,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
            stop_reason=finish.stop_reason if finish is not None else None,
            timings=timings,
            reasoning_tokens=run.watch.reasoning_tokens,
        )
        if tail is not None:
            stream.emit(tail)
        stream.emit(finished)
        return None

    def _count_error(self, kind: str) -> None:
        log.warning("upstream_error", engine=self.name, kind=kind, upstream=self.target.url)
        if self.observer is not None:
            self.observer.upstream_error(self.name, kind)


class _Submission:
    """One request's choices, each a task reading its upstream stream. Done callbacks, not a task waiting on
    them: when every choice ended, the stream ends; when one failed or the client left, the others are stopped
    (upstream too) in a task of their own, then the stream ends or fails."""

    def __init__(
        self,
        engine: UpstreamEngine,
        jobs: Sequence[GenerationJob],
        stream: GenerationStream,
        gate: _Gate,
        request_ids: Iterator[str],
    ) -> None:
        self._engine = engine
        self._jobs = jobs
        self._stream = stream
        self._gate = gate
        self._rids = [next(request_ids) for _ in jobs]
        self._tasks: list[asyncio.Task[None]] = []
        self._settled = False

    def start(self) -> None:
        """On the request's task (its log context is inherited): each choice's request is written now when a
        connection is idle, and read by a task of its own."""
        if self._settled:
            return  # the client left before the submission (the stream has ended)
        engine, loop = self._engine, asyncio.get_running_loop()
        for choice, job in enumerate(self._jobs):
            try:
                exchange: Exchange | BaseException = engine._send(job, choice, self._rids[choice], self._stream)
            except Exception as exc:  # raised by the choice's task, so it counts and reports as before
                exchange = exc
            task = loop.create_task(engine._choice(job, choice, self._rids, self._stream, self._gate, exchange))
            if isinstance(exchange, Exchange):
                task.add_done_callback(functools.partial(_discard, exchange))  # cancelled before it ran
            task.add_done_callback(self._ended)
            engine._tasks.add(task)
            task.add_done_callback(engine._tasks.discard)
            self._tasks.append(task)

    def client_left(self) -> None:
        self._settle()

    def _ended(self, task: asyncio.Task[None]) -> None:
        if all(t.done() for t in self._tasks) or (not task.cancelled() and task.exception() is not None):
            self._settle()

    def _settle(self) -> None:
        if self._settled:
            return
        self._settled = True
        pending = {t for t in self._tasks if not t.done()}
        if not pending:
            self._conclude()
            return
        stopper = asyncio.get_running_loop().create_task(self._stop(pending))
        self._engine._tasks.add(stopper)
        stopper.add_done_callback(self._engine._tasks.discard)

    async def _stop(self, pending: set[asyncio.Task[None]]) -> None:
        try:
            await self._engine._stop(pending, self._rids, self._tasks)
        finally:  # engine shutdown cancels this too: the stream still ends
            self._conclude()

    def _conclude(self) -> None:
        stream, gate = self._stream, self._gate
        error = next((t.exception() for t in self._tasks if t.done() and not t.cancelled() and t.exception()), None)
        if error is not None and not stream.cancelled.is_set():
            gate.fail(error)
            stream.fail(error if isinstance(error, DeltafinError) else str(error))
            return
        gate.cancel()
        stream.end()


def _on_loop(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> Callable[[], None]:
    """`callback`, run on `loop`'s thread whichever thread calls it (directly when that is the loop's thread,
    the usual case: a consumer's close, with no wake-up through the loop's pipe)."""
    loop_thread = threading.get_ident()  # made in `submit`, on the loop's thread

    def call() -> None:
        if threading.get_ident() == loop_thread:
            callback()
            return
        try:
            loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the loop is gone (shutdown): nothing left to tell
            pass

    return call


class _Gate:
    """Resolves once every choice saw its first upstream event; fails with the first error before that."""

    def __init__(self, future: asyncio.Future[None], choices: int) -> None:
        self._future = future
        self._waiting = choices

    def arrived(self) -> None:
        if self._waiting > 0:
            self._waiting -= 1
            if self._waiting == 0 and not self._future.done():
                self._future.set_result(None)

    def fail(self, error: BaseException) -> None:
        if not self._future.done():
            self._future.set_exception(error)
            self._future.exception()  # mark retrieved: nobody may be waiting any more

    def cancel(self) -> None:
        if not self._future.done():
            self._future.set_result(None)


@dataclass(eq=False)
class _ChoiceRun:
    """What one choice keeps across its upstream requests (more than one where its thinking budget resumed it)."""

    decoder: ChoiceDecoder
    watch: BudgetWatch
    resumes: int = 0
    #: the first request's prompt and cached tokens: the choice's usage
    prompt_tokens: int = 0
    cached: int = 0
    first_token_s: float | None = None


class _Refused(Exception):
    """The upstream refused the request inside its stream, before any token, and the adapter has changed what
    it sends: the request goes again."""


class _Unanswered(Exception):
    """The upstream request failed before its stream's first event (`cause`: the failure as it came)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _emit(stream: GenerationStream, deltas: list[TextDelta]) -> None:
    """One event for the deltas of one upstream read (consumers append texts, ids and logprobs alike)."""
    if len(deltas) == 1:
        stream.emit(deltas[0])
    elif deltas:
        first = deltas[0]
        stream.emit(
            TextDelta(
                first.choice,
                "".join(d.text for d in deltas),
                tuple(t for d in deltas for t in d.token_ids),
                tuple(lp for d in deltas for lp in d.logprobs),
            )
        )


def _aligned(chunk: Chunk):
    """(id, logprob) pairs; logprobs are matched by id, as an upstream may leave the stop token's out."""
    logprobs = list(chunk.logprobs)
    cursor = 0
    for token_id in chunk.token_ids:
        item = None
        entry = logprobs[cursor] if cursor < len(logprobs) else None
        if cursor < len(logprobs) and (entry is None or entry.token_id == token_id):
            item = entry
            cursor += 1
        yield token_id, item


def _discard(exchange: Exchange, _task: asyncio.Task) -> None:
    """A choice's task ended before it ran its exchange: give the exchange's connection back."""
    exchange.discard()
