"""The engine: one generation at a time on a worker thread, streamed to asyncio as engine events.

`Engine.start(jobs)` takes the slot (unless every job replays from the memo) and returns a
`GenerationStream` that yields `TextDelta`s and one `Finished` per job, choice after choice. Closing the
stream (the client left) stops generation at the next token; the slot is freed when the thread ends.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Sequence

import structlog
from transformers import DynamicCache

from deltafin.engine.detokenizer import IncrementalDetokenizer
from deltafin.engine.events import Finished, GenerationJob, PromptLogprobs, TextDelta
from deltafin.engine.generator import cache_argument, generate_tokens
from deltafin.engine.loader import LoadedModel
from deltafin.engine.memo import ResponseMemo
from deltafin.engine.prefix_cache import PrefixCache
from deltafin.engine.sampler import Sampler
from deltafin.engine.slot import EngineSlot
from deltafin.engine.stops import StopMatcher
from deltafin.errors import InternalError

log = structlog.get_logger("deltafin.engine")

Event = TextDelta | PromptLogprobs | Finished
_END = object()


class GenerationFailed(Exception):
    """Raised in the consumer when the generation thread failed; the cause is logged, not sent."""


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_waiting: int,
        timeout_s: float,
        memo_entries: int,
        prefix_cache_min_tokens: int | None = 16,
    ) -> None:
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        # The generation thread decodes with its own copy: encoding with split_special_tokens flips state
        # on the Rust tokenizer, and the event loop encodes prompts while a generation decodes.
        self._thread_tokenizer = copy.deepcopy(loaded.tokenizer)
        self.context_length = loaded.context_length
        self.stop_token_ids = loaded.stop_token_ids
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.slot = EngineSlot(max_waiting=max_waiting, timeout_s=timeout_s)
        self.memo = ResponseMemo(memo_entries)
        # min_tokens None turns reuse off: every prompt is prefilled from scratch.
        self.prefix_cache = PrefixCache(
            lambda: DynamicCache(config=self.model.config),
            min_reuse=prefix_cache_min_tokens if prefix_cache_min_tokens is not None else 1 << 62,
        )
        self.device = next(self.model.parameters()).device
        self.cache_arg = cache_argument(self.model)
        # One long-lived thread runs every generation: torch's per-thread state (the OpenMP team) is
        # built once instead of per request. Requests whose every choice is a memo hit never go there.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltafin-engine")

    async def start(self, jobs: Sequence[GenerationJob]) -> "GenerationStream":
        replays = [self.memo.get(job) if job.params.deterministic else None for job in jobs]
        needs_model = any(replay is None for replay in replays)
        queued_at = time.perf_counter()
        if needs_model:
            await self.slot.acquire()
        stream = GenerationStream(asyncio.get_running_loop(), queue_wait=time.perf_counter() - queued_at)
        if needs_model:
            self._worker.submit(self._run, jobs, replays, stream, self.slot.release)
        else:
            # Every choice is a memo hit: replay on the event loop, never queued behind a generation.
            self._run(jobs, replays, stream, None)
        return stream

    def _run(
        self,
        jobs: Sequence[GenerationJob],
        replays: list[tuple[object, ...] | None],
        stream: "GenerationStream",
        release: Callable[[], None] | None,
    ) -> None:
        try:
            for choice, (job, replay) in enumerate(zip(jobs, replays)):
                if stream.cancelled.is_set():
                    break
                if replay is not None:
                    for event in replay:
                        stream.emit(_with_choice(event, choice))
                    continue
                recorded = self._generate(job, choice, stream)
                if recorded is not None and job.params.deterministic:
                    self.memo.put(job, recorded)
        except Exception as exc:  # a model failure must not kill the server or leak a traceback
            log.exception("generation_failed")
            stream.emit(GenerationFailed(str(exc)))
        finally:
            # Free the slot before the consumer can see the end, so "done" always means "engine free".
            if release is not None:
                try:
                    stream.loop.call_soon_threadsafe(release)
                except RuntimeError:  # loop already closed (shutdown): nothing waits on the slot any more
                    pass
            stream.emit(_END)

    def _generate(self, job: GenerationJob, choice: int, stream: "GenerationStream") -> list[Event] | None:
        """Runs one job; returns its events for the memo, or None if it was cancelled."""
        params = job.params
        prompt_len = len(job.prompt_ids)
        max_new = min(params.max_tokens, self.context_length - prompt_len)
        sampler = Sampler(params, self.vocab_size, self.device, job.prompt_ids)
        detokenizer = IncrementalDetokenizer(self._thread_tokenizer)
        stops = StopMatcher(params.stop)
        stop_ids = self.stop_token_ids | frozenset(params.stop_token_ids)
        events: list[Event] = []
        timings: dict[str, float] = {}
        started = time.perf_counter()
        cached = 0

        def prefilled(reused: int) -> None:
            nonlocal cached
            cached = reused
            timings["prefill_s"] = time.perf_counter() - started

        def emit(event: Event) -> None:
            events.append(event)
            stream.emit(event)

        def prompt_logprobs(entries: list) -> None:
            emit(PromptLogprobs(choice, tuple(job.prompt_ids), tuple(entries)))

        count, reason, stop_reason = 0, "length", None
        steps = generate_tokens(
            self.model,
            self.prefix_cache,
            job.prompt_ids,
            sampler,
            max_new_tokens=max_new,
            stop_token_ids=stop_ids,
            cancel=stream.cancelled,
            cache_arg=self.cache_arg,
            on_prefilled=prefilled,
            on_prompt_logprobs=prompt_logprobs,
        )
        for step in steps:
            count += 1
            logprobs = (step.logprob,) if step.logprob is not None else ()
            if step.is_stop_token:
                # The stop token itself is neither text nor reported in logprobs (as OpenAI does).
                reason, stop_reason = "stop", step.token_id
                emit(TextDelta(choice, stops.flush(), (step.token_id,)))
                break
            text = stops.feed(detokenizer.push(step.token_id))
            emit(TextDelta(choice, text, (step.token_id,), logprobs))
            if stops.matched is not None:
                reason, stop_reason = "stop", stops.matched
                steps.close()
                break
        else:
            if stream.cancelled.is_set():
                return None
            emit(TextDelta(choice, stops.flush()))
        if stream.cancelled.is_set():
            return None
        timings["total_s"] = time.perf_counter() - started
        emit(Finished(choice, reason, prompt_len, count, cached, stop_reason, timings=timings))
        return events


def _with_choice(event: object, choice: int) -> object:
    """A memo entry replays under the choice index of the request that asked for it."""
    if isinstance(event, Finished):
        return dataclasses.replace(event, choice=choice, cached_tokens=0, memo_hit=True, timings={})
    if isinstance(event, (TextDelta, PromptLogprobs)):
        return dataclasses.replace(event, choice=choice)
    return event


class GenerationStream:
    """The consumer side of one generation: an async iterator of engine events."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, queue_wait: float) -> None:
        self.loop = loop
        self._loop_thread = threading.get_ident()  # created on the loop's thread
        self.queue_wait = queue_wait
        self.cancelled = threading.Event()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def emit(self, event: object) -> None:
        """Called from the generation thread, or from the loop itself for memo replays."""
        if threading.get_ident() == self._loop_thread:
            self._queue.put_nowait(event)  # no cross-thread wake-up needed
            return
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening any more
            self.cancelled.set()

    def close(self) -> None:
        """Stop generating at the next token. Synchronous, so it is safe inside a cancelled task."""
        self.cancelled.set()

    async def __aiter__(self) -> AsyncIterator[Event]:
        try:
            while True:
                event = await self._queue.get()
                if event is _END:
                    return
                if isinstance(event, GenerationFailed):
                    raise InternalError("The engine failed while generating; see the server log.")
                yield event
        finally:
            self.close()
