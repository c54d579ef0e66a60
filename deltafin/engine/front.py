"""What stands in front of every engine: admission (FIFO queue, 429 + Retry-After) and the deterministic memo.

Serving talks to an `EngineFront`, never to a concrete engine, so the queue, the memo and their metrics work
the same for the built-in torch engine and for an upstream vLLM / SGLang / llama-server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from deltafin.engine.admission import Admission
from deltafin.engine.events import Event, Finished, GenerationJob
from deltafin.engine.interface import EngineCapabilities, EngineClient, Readiness
from deltafin.engine.memo import ResponseMemo
from deltafin.engine.stream import GenerationStream
from deltafin.engine.timeline import Mark, current_timeline, now_ns


class EngineFront:
    def __init__(
        self,
        engine: EngineClient,
        *,
        max_waiting: int,
        timeout_s: float,
        memo_entries: int,
        long_prefill_tokens: int | None = None,
        max_long_prefills: int = 1,
    ) -> None:
        """`long_prefill_tokens`, `max_long_prefills`: admission by tokens (deltafin.engine.admission); None: off."""
        self.client = engine  # the engine behind this front (local or upstream)
        self.admission = Admission(
            capacity=engine.capacity,
            max_waiting=max_waiting,
            timeout_s=timeout_s,
            long_prefill_tokens=long_prefill_tokens,
            max_long_prefills=max_long_prefills,
        )
        self.memo = ResponseMemo(memo_entries)

    # What serving reads of the engine.
    @property
    def name(self) -> str:
        return self.client.name

    @property
    def tokenizer(self) -> Any:
        return self.client.tokenizer

    @property
    def context_length(self) -> int:
        return self.client.context_length

    @property
    def vocab_size(self) -> int:
        return self.client.vocab_size

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.client.stop_token_ids

    @property
    def capabilities(self) -> EngineCapabilities:
        return self.client.capabilities

    def observe(self, observer: Any) -> None:
        """Hand the engine the app's metrics (upstream latency and errors by kind)."""
        self.client.observer = observer

    async def readiness(self) -> Readiness:
        return await self.client.readiness()

    def expert_stats(self) -> Any:
        return self.client.expert_stats()

    def prefix_cache_stats(self) -> Any:
        return self.client.prefix_cache_stats()

    async def aclose(self) -> None:
        await self.client.aclose()

    async def start(self, jobs: Sequence[GenerationJob], *, deadline: float | None = None) -> GenerationStream:
        """Admit the request (or raise 429) and start it; `deadline` is a `time.monotonic()` instant."""
        loop = asyncio.get_running_loop()
        timeline = current_timeline.get()
        if timeline is not None:
            timeline.params, timeline.choices = jobs[0].params, len(jobs)
        replays = [self.memo.get(job) if job.params.deterministic and self.memo.enabled else None for job in jobs]
        if all(replay is not None for replay in replays):
            # Every choice is a memo hit: replay on the event loop, never queued behind a generation.
            stream = GenerationStream(loop, timeline=timeline)
            for choice, replay in enumerate(replays):
                assert replay is not None
                for event in replay:
                    stream.emit(_replayed(event, choice))
            stream.end()
            return stream
        queued_at, queued_ns = time.perf_counter(), now_ns() if timeline is not None else 0
        prompt_tokens = max(len(job.prompt_ids) for job in jobs)
        units = await self.admission.acquire(len(jobs), deadline=deadline, prompt_tokens=prompt_tokens)
        stream = GenerationStream(loop, queue_wait=time.perf_counter() - queued_at, timeline=timeline)
        if timeline is not None:
            timeline.add(Mark("queue", queued_ns, now_ns(), {"deltafin.queue.rows": len(jobs)}))
        stream.on_end(lambda: self.admission.release(units))
        if self.admission.is_long(prompt_tokens):
            _PrefillEnd(self.admission, stream)
        if self.memo.enabled and any(job.params.deterministic for job in jobs):
            stream.observe(_MemoRecorder(self.memo, jobs, stream))
        try:
            self.client.submit(jobs, stream)
        except BaseException:
            stream.end()
            raise
        try:
            await self.client.started(stream)
        except BaseException:  # the upstream refused, or the client left while we waited: stop it all
            stream.close()
            raise
        return stream


class _PrefillEnd:
    """Tells admission once that a long request's prefill is over: at its first event (its first token, from
    the engine's thread) or its end (cancelled, failed), whichever comes first, on the event loop."""

    def __init__(self, admission: Admission, stream: GenerationStream) -> None:
        self._admission = admission
        self._loop = stream.loop
        self._scheduled = False  # read and set on the emitting thread only
        self._told = False  # on the loop only
        stream.observe(self._first_event)
        stream.on_end(self._tell)

    def _first_event(self, event: object) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon_threadsafe(self._tell)

    def _tell(self) -> None:
        if not self._told:
            self._told = True
            self._admission.prefill_ended()


class _MemoRecorder:
    """Records each deterministic choice's events; a choice that finished uncancelled goes into the memo."""

    def __init__(self, memo: ResponseMemo, jobs: Sequence[GenerationJob], stream: GenerationStream) -> None:
        self._memo = memo
        self._jobs = jobs
        self._stream = stream
        self._events: dict[int, list[Event]] = {}

    def __call__(self, event: Event) -> None:
        choice = getattr(event, "choice", None)
        if choice is None or not self._jobs[choice].params.deterministic:
            return
        self._events.setdefault(choice, []).append(event)
        if isinstance(event, Finished) and not self._stream.cancelled.is_set():
            self._memo.put(self._jobs[choice], self._events.pop(choice))


def _replayed(event: Event, choice: int) -> Event:
    """A memo entry replays under the choice index of the request that asked for it."""
    if isinstance(event, Finished):
        return dataclasses.replace(event, choice=choice, cached_tokens=0, memo_hit=True, timings={})
    return dataclasses.replace(event, choice=choice)
