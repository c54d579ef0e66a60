"""The built-in torch engine: one generation at a time on a worker thread (the single owner of the device).

`submit(jobs, stream)` hands the request's choices to the worker thread, which runs them one after the other
and emits `TextDelta`s and one `Finished` per choice. Closing the stream (the client left) stops generation
at the next token. Admission and the memo stand in front of it (`deltafin.engine.front`).
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import structlog
from transformers import DynamicCache

from deltafin.engine.detokenizer import IncrementalDetokenizer
from deltafin.engine.events import Finished, GenerationJob, PromptLogprobs, TextDelta
from deltafin.engine.generator import cache_argument, generate_tokens
from deltafin.engine.interface import EngineCapabilities, EngineClient
from deltafin.engine.loader import LoadedModel
from deltafin.engine.prefix_cache import PrefixCache
from deltafin.engine.sampler import Sampler
from deltafin.engine.stops import StopMatcher
from deltafin.engine.stream import GenerationStream

log = structlog.get_logger("deltafin.engine")


class LocalEngine(EngineClient):
    name = "local"
    capabilities = EngineCapabilities(prompt_logprobs=True, grammar=False, cached_tokens=True)

    def __init__(self, loaded: LoadedModel, *, prefix_cache_min_tokens: int | None = 16) -> None:
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        # The generation thread decodes with its own copy: encoding with split_special_tokens flips state
        # on the Rust tokenizer, and the event loop encodes prompts while a generation decodes.
        self._thread_tokenizer = copy.deepcopy(loaded.tokenizer)
        self.context_length = loaded.context_length
        self.stop_token_ids = loaded.stop_token_ids
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.capacity = 1
        # min_tokens None turns reuse off: every prompt is prefilled from scratch.
        self.prefix_cache = PrefixCache(
            lambda: DynamicCache(config=self.model.config),
            min_reuse=prefix_cache_min_tokens if prefix_cache_min_tokens is not None else 1 << 62,
        )
        self.device = next(self.model.parameters()).device
        self.cache_arg = cache_argument(self.model)
        # One long-lived thread runs every generation: torch's per-thread state (the OpenMP team) is
        # built once instead of per request.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltafin-engine")

    def submit(self, jobs: Sequence[GenerationJob], stream: GenerationStream) -> None:
        self._worker.submit(self._run, jobs, stream)

    async def aclose(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _run(self, jobs: Sequence[GenerationJob], stream: GenerationStream) -> None:
        with structlog.contextvars.bound_contextvars(**stream.log_context):
            try:
                for choice, job in enumerate(jobs):
                    if stream.cancelled.is_set():
                        break
                    self._generate(job, choice, stream)
            except Exception as exc:  # a model failure must not kill the server or leak a traceback
                log.exception("generation_failed")
                stream.fail(str(exc))
                return
            stream.end()

    def _generate(self, job: GenerationJob, choice: int, stream: GenerationStream) -> None:
        """Runs one choice to its end, or to the next token after a cancel."""
        params = job.params
        prompt_len = len(job.prompt_ids)
        max_new = min(params.max_tokens, self.context_length - prompt_len)
        sampler = Sampler(params, self.vocab_size, self.device, job.prompt_ids)
        detokenizer = IncrementalDetokenizer(self._thread_tokenizer)
        stops = StopMatcher(params.stop)
        stop_ids = self.stop_token_ids | frozenset(params.stop_token_ids)
        timings: dict[str, float] = {}
        started = time.perf_counter()
        cached = 0

        def prefilled(reused: int) -> None:
            nonlocal cached
            cached = reused
            timings["prefill_s"] = time.perf_counter() - started

        emit = stream.emit

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
                return
            emit(TextDelta(choice, stops.flush()))
        if stream.cancelled.is_set():
            return
        timings["total_s"] = time.perf_counter() - started
        emit(Finished(choice, reason, prompt_len, count, cached, stop_reason, timings=timings))


