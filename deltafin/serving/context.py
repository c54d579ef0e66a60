"""What every endpoint needs: the engine, the chat format, limits, the served model's names."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from deltafin.config import DeltafinConfig, plain_config
from deltafin.config.models import name_matches
from deltafin.engine import EngineFront, Finished, GenerationJob, TextDelta
from deltafin.errors import ModelNotFoundError, quoted_name
from deltafin.families import BoundFamily, bind_family
from deltafin.prompt import ChatFormat
from deltafin.protocol.sampling import NO_DEFAULTS, SamplingDefaults
from deltafin.rules import RulePipeline
from deltafin.serving.prompt_work import PromptWork

T = TypeVar("T")


@dataclass
class RequestStats:
    """Filled in by serving, read by the access log line and the metrics."""

    started: float = field(default_factory=time.perf_counter)
    arrived: float = field(default_factory=time.monotonic)  # admission's deadline counts from here
    #: the size of what the prompt is rendered from: the body, and for a Responses request continuing a stored
    #: conversation the conversation too (it chooses the prompt-work lane: deltafin.serving.prompt_work)
    body_bytes: int = 0
    prompt_work_s: float = 0.0  # the request's own prompt work, which its admission deadline does not count
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_wait_s: float | None = None
    ttft_s: float | None = None
    prefill_s: float | None = None
    memo_hit: bool = False
    #: the served model that answered, and its engine's name (a process may serve several: deltafin.app.served)
    model: str | None = None
    engine: str | None = None
    # expert pool (placement.experts): lookups and bytes read for this request's share of the steps it ran in
    expert_hits: float = 0.0
    expert_misses: float = 0.0
    expert_prefill_bytes: float = 0.0
    expert_decode_bytes: float = 0.0
    # speculative decoding (engine.speculative): tokens guessed for this request's choices, and of them kept
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    rules: list[str] = field(default_factory=list)
    #: whose stored responses the request may read: a digest of its API key ("" on a server without keys)
    owner: str = ""
    #: response headers serving adds (name, value), sent by the request-context layer
    headers: list[tuple[str, str]] = field(default_factory=list)

    # Tokens of choices still generating, so a request cut short (disconnect, shutdown) logs what it produced.
    _partial: dict[int, int] = field(default_factory=dict, repr=False)

    def answered_by(self, ctx: ServingContext) -> None:
        """The served model the request was routed to, for its log line and metric labels."""
        self.model, self.engine = ctx.model_name, ctx.engine.name

    def saw(self, delta: TextDelta) -> None:
        self._partial[delta.choice] = self._partial.get(delta.choice, 0) + len(delta.token_ids)
        if delta.token_ids:
            # the first token, even one whose text is held back (a character's first bytes, a stop string's
            # start): a request whose few tokens all came out at its end had no TTFT at all
            self.first_token()

    @property
    def generated_tokens(self) -> int:
        """Finished choices' completion tokens plus those seen so far of unfinished ones."""
        return self.completion_tokens + sum(self._partial.values())

    def record(self, finished: Finished) -> None:
        self._partial.pop(finished.choice, None)
        self.completion_tokens += finished.completion_tokens
        self.cached_tokens = max(self.cached_tokens, finished.cached_tokens)
        self.memo_hit = self.memo_hit or finished.memo_hit
        self.finish_reasons.append(finished.reason)
        if self.prefill_s is None and "prefill_s" in finished.timings:
            self.prefill_s = finished.timings["prefill_s"]
        timings = finished.timings
        self.spec_draft_tokens += int(timings.get("spec_draft_tokens", 0))
        self.spec_accepted_tokens += int(timings.get("spec_accepted_tokens", 0))
        if "expert_hits" in timings:  # each choice carries its own share (deltafin.engine.experts.charge)
            self.expert_hits += timings["expert_hits"]
            self.expert_misses += timings["expert_misses"]
            self.expert_prefill_bytes += timings.get("expert_prefill_bytes", 0.0)
            self.expert_decode_bytes += timings.get("expert_decode_bytes", 0.0)

    @property
    def _choices(self) -> int:
        return len(self.finish_reasons) + len(self._partial)

    def expert_fields(self) -> dict[str, float]:
        """The request log line's expert-pool fields (none when no pool served it)."""
        lookups = self.expert_hits + self.expert_misses
        if not lookups:
            return {}
        return {
            "expert_hit_rate": round(self.expert_hits / lookups, 4),
            # a choice's first token comes from the prefill; each later one from a decode step
            "expert_bytes_per_token": round(self.expert_decode_bytes / max(1, self.generated_tokens - self._choices)),
            "expert_prefill_bytes": round(self.expert_prefill_bytes),
        }

    def spec_fields(self) -> dict[str, float]:
        """The request log line's speculation fields (none when nothing was guessed for it)."""
        if not self.spec_draft_tokens:
            return {}
        return {
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            "spec_acceptance": round(self.spec_accepted_tokens / self.spec_draft_tokens, 4),
        }

    def first_token(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.started


@dataclass
class ServingContext:
    """Shared by the endpoint services. Prompt work (templating, tokenizing) runs on one thread of its own:
    a 4 MB prompt takes seconds to tokenize, which on the event loop would stall every other client's stream."""

    config: DeltafinConfig
    engine: EngineFront
    chat_format: ChatFormat
    rules: RulePipeline = field(default_factory=RulePipeline)
    created: int = field(default_factory=lambda: int(time.time()))
    _token_texts: dict[int, str] = field(default_factory=dict, repr=False)
    prompt: PromptWork | None = None  # None: built from the config in __post_init__
    #: checks and compiles constraints off the event loop (deltafin.grammar.service.Grammars; typed Any so that
    #: importing serving does not import xgrammar, and torch with it); None: the engine cannot constrain, and a
    #: constrained request is a 400
    grammars: Any = None
    #: the model's default sampling, for what a request leaves out (deltafin.serving.sampling_defaults)
    sampling_defaults: SamplingDefaults = NO_DEFAULTS
    #: the served model's family, bound to its variant here, once (what serving asks of it: parsers, grammars)
    family: BoundFamily = field(init=False)

    def __post_init__(self) -> None:
        # Read per request (model name, limits, templates): plain attributes, not omegaconf nodes (~18 us a read).
        self.config = plain_config(self.config)
        self.family = bind_family(self.config.model.family, self.config.model.variant)
        # Each thread gets its own tokenizer (`self.tokenizer`): encoding flips `split_special_tokens` state on the
        # Rust object, so a shared one could let a prompt's content be encoded with control tokens live. The
        # prompt threads and the event loop each use their own copy (the loop's renders small prompts and counts
        # tokens), the engine its own.
        if self.prompt is None:
            self.prompt = prompt_work_for(self.config, self.engine.tokenizer)

    @property
    def work(self) -> PromptWork:
        """The prompt threads (set from the config once built)."""
        assert self.prompt is not None
        return self.prompt

    @property
    def tokenizer(self) -> Any:
        """The calling thread's own tokenizer (prompt threads; see prompt_work)."""
        return self.work.tokenizers.get()

    def deadline(self, stats: RequestStats) -> float:
        """When a request must be admitted to the engine or refused: `queue.timeout_s` of waiting after it
        arrived (its own prompt work, done so far, not counted)."""
        return stats.arrived + self.config.server.queue.timeout_s + stats.prompt_work_s

    def scoped(self, jobs: list[GenerationJob], stats: RequestStats) -> list[GenerationJob]:
        """The jobs with the prefix-cache scope of the request: its API key's digest under
        `server.prefix_cache.scope=api_key` (an opaque id: the engine sees no key), else shared by everyone."""
        if self.config.server.prefix_cache.scope != "api_key" or not stats.owner:
            return jobs
        return [dataclasses.replace(job, cache_scope=stats.owner) for job in jobs]

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    async def off_loop(
        self,
        fn: Callable[..., T],
        *args: Any,
        size: int | None = None,
        stats: RequestStats | None = None,
        inline: bool = True,
    ) -> T:
        """Run prompt work on a prompt thread: the lane for a body of `size` bytes, or here on the loop for a small
        one when `inline` (deltafin.serving.prompt_work); with `stats`, refused if no thread is free by the
        request's deadline, and the work's own time recorded."""
        if stats is None:
            return await self.work.run(lambda: fn(*args), size=size, inline=inline)

        def timed() -> T:
            began = time.monotonic()
            try:
                return fn(*args)
            finally:
                stats.prompt_work_s += time.monotonic() - began

        return await self.work.run(timed, size=size, deadline=self.deadline(stats), inline=inline)

    fingerprint: str = "fp_deltafin"

    @staticmethod
    def created_now() -> int:
        return int(time.time())

    @property
    def model_name(self) -> str:
        return self.config.model.name

    def serves(self, name: str) -> bool:
        """`name` is the served model's name or an alias (an alias with `*` is a pattern of names)."""
        return name == self.model_name or any(name_matches(alias, name) for alias in self.config.model.aliases)

    def check_model(self, requested: str | None) -> None:
        """`model` is optional; when given it must name the served model or one of its aliases."""
        if requested is None or self.serves(requested):
            return
        raise ModelNotFoundError(
            f"The model `{quoted_name(requested)}` does not exist. This server serves `{self.model_name}`.",
            param="model",
        )

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }


def new_id(prefix: str) -> str:
    return f"{prefix}-{os.urandom(16).hex()}"


def prompt_work_for(config: DeltafinConfig, tokenizer: Any) -> PromptWork:
    queue = config.server.queue
    return PromptWork(
        tokenizer,
        large_body_bytes=queue.large_body_bytes,
        max_large=queue.max_large_prompts,
        timeout_s=queue.timeout_s,
        inline_body_bytes=queue.inline_body_bytes,
    )
