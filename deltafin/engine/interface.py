"""The one engine interface serving depends on (after vLLM's `EngineClient`).

An engine turns generation jobs into engine events. The built-in torch engine (`deltafin.engine.local.engine`) is one
implementation; the upstream adapters (vLLM, SGLang, llama-server) are others. Admission (the FIFO queue, 429)
and the deterministic memo are not the engine's job: `EngineFront` stands in front of every engine.

Contract of `submit(jobs, stream)`:
- it returns at once (called on the event loop); generation happens elsewhere (a thread, an asyncio task);
- choice `i` of the request is `jobs[i]`; for each choice the engine emits zero or one `PromptLogprobs`,
  `TextDelta`s, then exactly one `Finished` (unless cancelled);
- it ends every submission with `stream.end()`, or `stream.fail(error)` when it cannot go on, after it has
  freed whatever the submission held (so "ended" always means "capacity free");
- it watches `stream.cancelled` (the client left) and stops at the next token, emitting no `Finished`.

`started(stream)` lets an engine that learns of failures late (an upstream over HTTP) hold the answer until the
generation is known to run: an error raised there is a real HTTP status, not an in-stream error event.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deltafin.engine.events import GenerationJob

if TYPE_CHECKING:
    from deltafin.engine.stream import GenerationStream


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do beyond plain sampling; serving refuses what the engine cannot honour."""

    prompt_logprobs: bool = True
    #: constrained decoding (structured outputs / enforced tool calls)
    grammar: bool = False
    #: the engine runs the grammar itself and needs each constrained job's grammar compiled for its tokenizer
    #: (`GenerationJob.grammar`); otherwise it forwards the constraint (an upstream compiles it)
    compiled_grammar: bool = False
    #: the engine reports how many prompt tokens came from its own cache
    cached_tokens: bool = True


@dataclass(frozen=True)
class Readiness:
    ready: bool
    detail: str = ""


class EngineClient(ABC):
    #: short name for logs and metrics ("local", "vllm", "sglang", "llama_server")
    name: str
    #: the tokenizer prompts are rendered and detokenized with (local files only)
    tokenizer: Any
    context_length: int
    stop_token_ids: frozenset[int]
    vocab_size: int
    #: generations (rows) that may run at once; admission queues the rest
    capacity: int
    capabilities: EngineCapabilities = EngineCapabilities()
    #: where an engine that talks to an upstream reports its latency and errors (the app's metrics); optional
    observer: Any = None

    @abstractmethod
    def submit(self, jobs: Sequence[GenerationJob], stream: GenerationStream) -> None:
        """Start generating `jobs` (the choices of one request); see the module docstring."""

    async def started(self, stream: GenerationStream) -> None:  # noqa: B027 (optional: most engines start at once)
        """Return once `stream`'s generation is under way, or raise the DeltafinError that prevents it."""

    async def readiness(self) -> Readiness:
        return Readiness(True)

    async def aclose(self) -> None:  # noqa: B027 (optional: an engine with nothing to release)
        """Release threads, connections and device memory; no submission follows."""

    def expert_stats(self) -> Any:
        """The expert pool's counters (`deltafin.engine.experts.PoolStats`) for /metrics; None without one."""
        return None

    def prefix_cache_stats(self) -> Any:
        """The prefix cache's counters by tier (`deltafin.engine.kv.tier_stats.TierStats`) for /metrics; None
        for an engine without one of its own."""
        return None
