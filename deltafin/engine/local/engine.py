"""The built-in torch engine: one owner thread runs every request as rows of one batch (continuous batching).

`submit(jobs, stream)` hands the request to the owner thread. Each iteration of its loop:
1. takes what arrived: each distinct prompt of a request (the `n` choices of a request share one prefill)
   becomes a prompt in prefill, with its own one-row cache (from the prefix cache where it can; a prefix the
   prefix cache reads back from disk is read on its own thread, and the prompt is passed over until it is in);
2. drops cancelled rows and prompts;
3. prefills at most `prefill_chunk` prompt positions (chunked prefill): the prompt at the head of the
   prefill queue gets them; one that finishes samples its rows' first tokens and they join the batch (and
   what is left of the budget goes to the next prompt); one that does not goes to the back of the queue
   (round-robin: no prompt waits for another's whole prefill, however long that is);
4. decodes one token for every running row (with speculation, `engine.speculative`: each row's draft checked
   in the same pass, deltafin.engine.local.speculative).
So a running stream waits at most one chunk plus one step for its next token, whatever arrives. Finished and
cancelled rows leave at once, giving their KV cache to the prefix cache; a prompt cancelled or failed in
prefill gives nothing back (its cache is partial). Admission (`capacity = max_batch` rows) and the memo stand
in front of it (`deltafin.engine.front`). Constrained jobs arrive with their grammar compiled
(`GenerationJob.grammar`): the owner thread never compiles.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import queue
import threading
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import structlog
import torch
from transformers import DynamicCache

from deltafin.config import SpeculativeConfig
from deltafin.engine.events import GenerationJob, PromptLogprobs
from deltafin.engine.experts import PoolCounters, PoolStats
from deltafin.engine.experts import charge as charge_experts
from deltafin.engine.interface import EngineCapabilities, EngineClient
from deltafin.engine.kv.batch import BatchKV
from deltafin.engine.kv.prefix_cache import PrefixCache, PrefixCacheSettings, Reuse
from deltafin.engine.kv.tier_stats import TierStats
from deltafin.engine.local.generator import PREFILL_CHUNK, PromptPrefill, cache_argument
from deltafin.engine.local.prefill_order import finishing_first
from deltafin.engine.local.row import Row, Submission
from deltafin.engine.local.sampler import Sampler
from deltafin.engine.local.speculative import speculation_for
from deltafin.engine.local.steps import decode_step_for
from deltafin.engine.stream import GenerationStream
from deltafin.engine.text.choice_decoder import ChoiceDecoder
from deltafin.engine.text.reasoning_budget import reasoning_tracker
from deltafin.engine.timeline import Mark, now_ns
from deltafin.engine.weights.loader import LoadedModel
from deltafin.errors import InvalidRequestError

log = structlog.get_logger("deltafin.engine")
bound = structlog.contextvars.bound_contextvars

_STOP = object()
#: put in the inbox by the prefix cache's disk reader when a prompt's prefix is in: an idle loop looks again
_WAKE = object()
#: how many scheduling records (`step_sizes`, `schedule`) are kept for tests and benchmarks
_RECORDS = 4096


@dataclass(eq=False)
class PromptInPrefill:
    """One distinct prompt of a submission, prefilled chunk by chunk; its choices join the batch at the end."""

    sub: Submission
    choices: list[int]
    #: what the prefix cache gives the prompt; not `ready` while its prefix is read from disk
    reuse: Reuse
    #: the prefill, once the prompt's cache is settled
    work: PromptPrefill | None = None
    cached: int = 0
    #: the expert pool's reads for this prompt's chunks so far (placement.experts.pool_mb), else None
    pool_spent: PoolCounters | None = None
    #: perf_counter when the owner thread took the request (its rows' prefill and total times count from here)
    started: float = field(default_factory=time.perf_counter)
    #: a traced request's prefill chunks so far (deltafin.engine.timeline), else None; and when it was taken
    chunks: list[Mark] | None = None
    started_ns: int = 0

    @property
    def stream(self) -> GenerationStream:
        return self.sub.stream


class LocalEngine(EngineClient):
    name = "local"

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        prefix_cache_min_tokens: int | None = 16,
        max_batch: int = 8,
        prefix_cache: PrefixCacheSettings | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        threads: int | None = None,
        speculative: SpeculativeConfig | None = None,
        draft: LoadedModel | None = None,
    ) -> None:
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        # The owner thread decodes with its own copy: encoding with split_special_tokens flips state
        # on the Rust tokenizer, and the event loop encodes prompts while a generation decodes.
        self._thread_tokenizer = copy.deepcopy(loaded.tokenizer)
        self.context_length = loaded.context_length
        self.stop_token_ids = loaded.stop_token_ids
        head = self.model.get_output_embeddings()
        self.vocab_size = int(getattr(head, "out_features", None) or head.weight.shape[0])
        self.capacity = max(1, max_batch)
        # Constrained jobs bring their grammar compiled for this tokenizer (GenerationJob.grammar).
        self.capabilities = EngineCapabilities(
            prompt_logprobs=True, grammar=True, cached_tokens=True, compiled_grammar=True
        )
        #: prompt positions prefilled per loop iteration (engine.prefill_chunk_tokens), shared by the prompts
        self.prefill_chunk = max(1, prefill_chunk)
        self.device = next(self.model.parameters()).device
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        # min_tokens None turns reuse off: every prompt is prefilled from scratch, and nothing is stored.
        if prefix_cache is None:
            prefix_cache = PrefixCacheSettings(
                enabled=prefix_cache_min_tokens is not None, min_tokens=prefix_cache_min_tokens or 1
            )
        self.prefix_cache = PrefixCache(
            lambda: DynamicCache(config=self.model.config),
            prefix_cache,
            device=self.device,
            wake=lambda: self._inbox.put(_WAKE),
        )
        #: the expert pool (placement.experts.pool_mb), read only for per-request counters and /metrics
        self.experts = loaded.experts
        self.cache_arg = cache_argument(self.model)
        self.decode = decode_step_for(self.model, compile=loaded.compile)
        #: engine.speculative (None: every step decodes one token a row)
        self.speculation = speculation_for(speculative, loaded, self.decode, self.cache_arg, draft=draft)
        self._rows: list[Row] = []
        self._prefilling: collections.deque[PromptInPrefill] = collections.deque()
        self._kv = BatchKV(self.device)
        #: how many rows each decode step ran, the latest steps (tests and benchmarks read it)
        self.step_sizes: collections.deque[int] = collections.deque(maxlen=_RECORDS)
        #: what the owner thread did, in order: ("prefill", positions) and ("step", rows) (tests read it)
        self.schedule: collections.deque[tuple[str, int]] = collections.deque(maxlen=_RECORDS)
        # One long-lived thread owns the device: torch's per-thread state (the OpenMP team) is built once.
        # torch's threads for the device work; set on the owner thread itself (see `_loop`).
        self.threads = threads
        self._owner = threading.Thread(target=self._loop, name="deltafin-engine", daemon=True)
        self._owner.start()

    def submit(self, jobs: Sequence[GenerationJob], stream: GenerationStream) -> None:
        self._inbox.put(Submission(stream, tuple(jobs)))

    async def aclose(self) -> None:
        """Stop the owner thread and wait for it: rows still running are cancelled, queued work ends."""
        self._inbox.put(_STOP)
        await asyncio.to_thread(self._owner.join, 30)
        if self.experts is not None:
            self.experts.close()
        await asyncio.to_thread(self.prefix_cache.close)

    def expert_stats(self) -> PoolStats | None:
        """The expert pool's counters for /metrics (None without a pool)."""
        return self.experts.stats() if self.experts is not None else None

    def prefix_cache_stats(self) -> TierStats:
        """The prefix cache's counters by tier, for /metrics."""
        return self.prefix_cache.stats

    # The owner thread.

    def _loop(self) -> None:
        # OpenMP keeps one team of worker threads per thread that runs parallel work. When the thread that
        # loaded the model had its own team, every decode step here ran about 2x slower on 2 cores (measured:
        # docs/benchmarks.md, "One thread runs torch"); `build_local_engine` loads with one thread, so this
        # thread's team is the only one, and it takes the configured number here.
        if self.threads:
            torch.set_num_threads(self.threads)
        with torch.inference_mode():
            while True:
                # Prompts whose prefix is still read from disk are not work: the reader wakes the loop.
                idle = not self._rows and not any(prompt.reuse.ready for prompt in self._prefilling)
                arrived = [self._inbox.get()] if idle else []
                while True:  # everything that arrived during the last step is taken before the next one
                    try:
                        arrived.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for item in arrived:
                    if item is _STOP:
                        self._shutdown()
                        return
                    if item is _WAKE:
                        continue
                    self._admit(item)  # type: ignore[arg-type]  # the inbox holds submissions besides the two sentinels handled above
                self._drop_cancelled()
                if self._prefilling:
                    self._prefill_chunk()
                if self._rows:
                    self._step() if self.speculation is None else self._speculative_step()

    def _admit(self, sub: Submission) -> None:
        """Check the request and queue its distinct prompts for prefill."""
        with bound(**sub.stream.log_context):
            if sub.stream.cancelled.is_set():
                sub.stream.end()
                return
            if any(job.params.constraint is not None and job.grammar is None for job in sub.jobs):
                sub.fail(
                    InvalidRequestError(
                        "Constrained decoding (response_format / enforced tool calls) needs a grammar compiled "
                        "before the request is submitted; none came with it.",
                        param="response_format",
                    )
                )
                return
            if not all(job.prompt_ids for job in sub.jobs):
                sub.fail(InvalidRequestError("The prompt is empty: at least one token is needed.", param="prompt"))
                return
            # Serving sizes every job to the context (deltafin.serving.plan.token_budget); one that does not fit
            # came from elsewhere and is refused, never cut here.
            if any(len(job.prompt_ids) + job.params.max_tokens > self.context_length for job in sub.jobs):
                sub.fail(
                    InvalidRequestError("The prompt and max_tokens do not fit the model's context.", param="max_tokens")
                )
                return
            sub.rows_left = len(sub.jobs)
            groups: dict[tuple, list[int]] = {}
            for choice, job in enumerate(sub.jobs):
                groups.setdefault((job.prompt_ids, job.params.prompt_logprobs), []).append(choice)
            try:
                for choices in groups.values():
                    self._admit_group(sub, choices)
            except Exception as exc:  # a model failure must not kill the owner thread or leak a traceback
                self._fail_submission(sub, exc)

    def _admit_group(self, sub: Submission, choices: list[int]) -> None:
        """One distinct prompt: its cache (reused from the prefix cache where it can) and its prefill, queued."""
        job = sub.jobs[choices[0]]
        want_prompt = job.params.prompt_logprobs
        # Prompt logprobs need logits at every prompt position, so nothing may come from the cache.
        reuse = self.prefix_cache.take(() if want_prompt is not None else job.prompt_ids, job.cache_scope)
        prompt = PromptInPrefill(sub, choices, reuse)
        if sub.stream.timeline is not None:
            prompt.chunks, prompt.started_ns = [], now_ns()
        self._prefilling.append(prompt)

    def _started(self, prompt: PromptInPrefill) -> bool:
        """The prompt's prefill exists (made here once its cache is settled); False while its prefix is still
        read from disk."""
        if prompt.work is None:
            if not prompt.reuse.ready:
                return False
            cache, prompt.cached = self.prefix_cache.settle(prompt.reuse)
            job = prompt.sub.jobs[prompt.choices[0]]
            prompt.work = PromptPrefill(
                self.model,
                job.prompt_ids,
                cache,
                prompt.cached,
                cache_arg=self.cache_arg,
                prompt_logprobs=job.params.prompt_logprobs,
            )
        return True

    def _prefill_chunk(self) -> None:
        """At most `prefill_chunk` prompt positions, round-robin over the prompts in prefill."""
        budget = self.prefill_chunk
        finishing_first(self._prefilling, budget)  # a short prompt starts in the next step, long ones mid-prefill
        waiting = 0  # prompts passed over since the last one that ran: their prefixes are read from disk
        while self._prefilling and budget > 0 and waiting < len(self._prefilling):
            prompt = self._prefilling[0]
            with bound(**prompt.stream.log_context):
                try:
                    if not self._started(prompt):
                        self._prefilling.rotate(-1)
                        waiting += 1
                        continue
                    waiting = 0
                    assert prompt.work is not None
                    positions = min(prompt.work.remaining, budget)
                    pool_before = self.experts.counters() if self.experts is not None else None
                    began = now_ns() if prompt.chunks is not None else 0
                    prompt.work.run(positions)
                    if prompt.chunks is not None:
                        prompt.chunks.append(Mark("prefill chunk", began, now_ns(), {"deltafin.positions": positions}))
                    if pool_before is not None:  # this chunk's expert reads, charged to the prompt's rows
                        spent = self.experts.counters() - pool_before
                        prompt.pool_spent = spent if prompt.pool_spent is None else prompt.pool_spent + spent
                    self.schedule.append(("prefill", positions))
                    budget -= positions
                    if not prompt.work.done:
                        self._prefilling.rotate(-1)  # the budget is spent; the next prompt goes first next time
                        return
                    self._prefilling.popleft()
                    self._join(prompt)
                except Exception as exc:
                    self._fail_submission(prompt.sub, exc)

    def _join(self, prompt: PromptInPrefill) -> None:
        """The prompt is in its cache: sample each choice's first token; the rows join the batch."""
        sub, work = prompt.sub, prompt.work
        assert work is not None
        ids = work.ids
        prefill_s = time.perf_counter() - prompt.started
        joined_ns = self._mark_prefill(prompt)
        joining: list[Row] = []
        for choice in prompt.choices:
            row = self._new_row(sub, choice, prompt.cached, prompt.started)
            row.timings["prefill_s"] = prefill_s
            row.joined_ns = joined_ns
            if prompt.pool_spent is not None:  # the prefill's expert reads, shared by its choices (log line)
                charge_experts(row.timings, prompt.pool_spent, share=len(prompt.choices), decode=False)
            if work.prompt_logprobs is not None:
                sub.stream.emit(PromptLogprobs(choice, tuple(ids), tuple(work.entries)))
            if row.max_new <= 0:
                row.finish_empty()
                sub.row_left()
                continue
            assert work.logits is not None  # the prefill is done
            if row.take(int(row.sampler.sample(work.logits)), work.logits):
                sub.row_left()
            else:
                joining.append(row)
        if joining:
            self._kv.add(work.cache, len(ids), copies=len(joining))
            self._rows.extend(joining)
        if self.speculation is not None:
            self.speculation.joined(joining, work)
        # The prompt's cache is offered again whatever happened (a row that ended at its first token included).
        self.prefix_cache.give_back(work.cache, ids, sub.jobs[prompt.choices[0]].cache_scope)

    @staticmethod
    def _mark_prefill(prompt: PromptInPrefill) -> int:
        """A traced prompt's prefill (from its being taken, a disk read of its prefix included), its chunks under
        it; the instant its rows start decoding (0: not traced)."""
        timeline = prompt.stream.timeline
        if timeline is None or prompt.chunks is None or prompt.work is None:
            return 0
        ended = now_ns()
        attributes = {
            "gen_ai.usage.input_tokens": len(prompt.work.ids),
            "gen_ai.usage.cache_read.input_tokens": prompt.cached,
            "deltafin.choices": len(prompt.choices),
        }
        timeline.add(Mark("prefill", prompt.started_ns, ended, attributes, children=prompt.chunks))
        return ended

    def _fail_submission(self, sub: Submission, exc: Exception) -> None:
        """Everything of `sub` stops: its rows leave, its prompts in prefill are dropped (caches not offered)."""
        log.exception("generation_failed", exc_info=exc)
        sub.fail(str(exc))  # first: the rows leaving below must not end the stream as a success
        self._prefilling = collections.deque(p for p in self._prefilling if p.sub is not sub)
        self._remove(lambda row: row.submission is sub)

    def _new_row(self, sub: Submission, choice: int, cached: int, started: float) -> Row:
        job = sub.jobs[choice]
        params = job.params
        # The grammar came compiled (checked in _admit); each row gets a matcher of its own.
        constraint = job.grammar.matcher() if params.constraint is not None else None
        reasoning = reasoning_tracker(params, self._thread_tokenizer)
        return Row(
            submission=sub,
            choice=choice,
            sampler=Sampler(params, self.vocab_size, self.device, job.prompt_ids, constraint, reasoning),
            decoder=ChoiceDecoder(self._thread_tokenizer, params, self.stop_token_ids, choice),
            max_new=params.max_tokens,
            prompt_len=len(job.prompt_ids),
            cached=cached,
            started=started,
            ids=list(job.prompt_ids),
        )

    def _step(self) -> None:
        """One decode step for every running row."""
        rows = self._rows
        self.step_sizes.append(len(rows))
        self.schedule.append(("step", len(rows)))
        tokens = torch.tensor([[row.pending] for row in rows], device=self.device)  # [B, 1]
        for row in rows:
            row.ids.append(row.pending)  # type: ignore[arg-type]  # a row in a decode step has its pending token
        mask, positions = self._kv.step_inputs()
        pool_before = self.experts.counters() if self.experts is not None else None
        try:
            logits = self.decode(self.model, tokens, mask, positions, self._kv.cache, cache_arg=self.cache_arg)
            # logits: [B, V]
        except Exception as exc:
            self._fail_batch(rows, exc)
            return
        self._kv.advanced(mask)
        if pool_before is not None:  # the step's expert reads, shared by its rows (request log line)
            pool_spent = self.experts.counters() - pool_before
            for row in rows:
                charge_experts(row.timings, pool_spent, share=len(rows), decode=True)
        failed: set[int] = set()
        draws: list[torch.Tensor] = []
        for i, row in enumerate(rows):
            with bound(**row.stream.log_context):
                try:
                    draws.append(row.sampler.sample(logits[i]))
                except Exception as exc:  # e.g. a constraint object that raises: only its request fails
                    draws.append(torch.zeros((), dtype=torch.long, device=self.device))
                    self._fail_row(row, exc, failed)
        tokens_host = torch.stack(draws).tolist()  # the one device -> host transfer of the step
        finished: set[int] = set()
        for i, row in enumerate(rows):
            if id(row.submission) in failed:
                continue
            with bound(**row.stream.log_context):
                try:
                    if row.take(tokens_host[i], logits[i]):
                        finished.add(i)
                except Exception as exc:
                    self._fail_row(row, exc, failed)
        self._remove(lambda row: id(row.submission) in failed, finished)

    def _speculative_step(self) -> None:
        """`_step` with speculation: each row's draft, if it has one, is checked in the same pass."""
        assert self.speculation is not None
        rows = self._rows
        self.step_sizes.append(len(rows))
        self.schedule.append(("step", len(rows)))
        pool_before = self.experts.counters() if self.experts is not None else None
        try:
            checked = self.speculation.verify(rows, self._kv)
        except Exception as exc:
            self._fail_batch(rows, exc)
            return
        if pool_before is not None:
            pool_spent = self.experts.counters() - pool_before
            for row in rows:
                charge_experts(row.timings, pool_spent, share=len(rows), decode=True)
        failed: set[int] = set()
        try:  # a row's own failure (its sampler, its grammar) fails only its request; anything else, the batch
            finished = self.speculation.settle(
                checked, self._kv, failed, lambda row, exc: self._fail_row(row, exc, failed)
            )
        except Exception as exc:
            self._fail_batch(rows, exc)
            return
        self._remove(lambda row: id(row.submission) in failed, finished)

    def _fail_batch(self, rows: list[Row], exc: Exception) -> None:
        """A step's forward failed: every running request fails, the batch starts empty."""
        log.exception("generation_failed", exc_info=exc)
        subs = {id(row.submission): row.submission for row in rows}
        self._rows, self._kv = [], BatchKV(self.device)
        self._prefilling = collections.deque(p for p in self._prefilling if id(p.sub) not in subs)
        for sub in subs.values():
            sub.fail(str(exc))

    def _fail_row(self, row: Row, exc: Exception, failed: set[int]) -> None:
        log.exception("generation_failed")
        failed.add(id(row.submission))
        row.submission.fail(str(exc))

    def _drop_cancelled(self) -> None:
        self._remove(lambda row: row.stream.cancelled.is_set())
        if any(prompt.stream.cancelled.is_set() for prompt in self._prefilling):
            kept: collections.deque[PromptInPrefill] = collections.deque()
            for prompt in self._prefilling:
                if not prompt.stream.cancelled.is_set():
                    kept.append(prompt)
                    continue
                # Its partial cache is dropped with it, never offered to the prefix cache.
                for _ in prompt.choices:
                    prompt.sub.row_left()
            self._prefilling = kept

    def _remove(self, predicate, finished: AbstractSet[int] = frozenset()) -> None:
        """Rows that finished (by index) or match `predicate` leave the batch; their caches go to the prefix cache."""
        keep: list[int] = []
        for i, row in enumerate(self._rows):
            if i in finished or predicate(row):
                # Keys/values of every fed token are in the cache: offer them to the next request.
                scope = row.submission.jobs[row.choice].cache_scope
                self.prefix_cache.give_back(self._kv.row_cache(i), row.ids, scope)
                row.submission.row_left()
            else:
                keep.append(i)
        if len(keep) != len(self._rows):
            self._rows = [self._rows[i] for i in keep]
            self._kv.keep(keep)

    def _shutdown(self) -> None:
        for row in self._rows:
            row.stream.cancelled.set()
        for prompt in self._prefilling:
            prompt.stream.cancelled.set()
        self._drop_cancelled()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Submission):
                item.stream.end()
