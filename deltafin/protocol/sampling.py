"""The engine-facing generation parameters one choice is produced with."""

from __future__ import annotations

from dataclasses import dataclass, field

#: JSON whitespace between two tokens of a constrained value, as llama.cpp's JSON grammar bounds it
#: (common/json-schema-to-grammar.cpp, SPACE_RULE): nothing, one space, or one or two newlines followed by at most
#: MAX_INDENT spaces or tabs. Unbounded whitespace is the classic way a small model loops inside a constrained
#: object (a tiny Kimi K2 wrote ten `\r\n` between a key and its value); the bound still fits pretty-printed
#: nesting. Part of what a JSON constraint means, whoever builds it: deltafin.grammar's compiles (xgrammar and
#: llama-server's GBNF) write exactly this rule.
MAX_INDENT = 20
MAX_NEWLINES = 2
#: xgrammar's own option, the longest run of any whitespace (`max_whitespace_cnt`), for the structural tags and
#: schemas an upstream vLLM / SGLang compiles itself: the nearest bound its options can say
MAX_WHITESPACE = 20


@dataclass(frozen=True)
class Constraint:
    """A constrained-decoding request, engine-neutral and hashable (so it is part of the memo key).

    kind: "json_object" (value ""), "json_schema" (value: the schema as compact JSON, key order kept: it is the output order),
    "structural_tag" (value: an xgrammar structural-tag description as canonical JSON; used to force a
    family's native tool-call syntax). The local engine compiles it with xgrammar; upstream adapters forward
    it in their engine's own field."""

    kind: str
    value: str = ""


@dataclass(frozen=True)
class ReasoningBudget:
    """At most `tokens` reasoning tokens in one choice (a request's `thinking_token_budget`), with what the engine
    needs of the family's reasoning markup to hold it there (deltafin.serving.thinking_budget builds it).

    Reasoning tokens are the tokens between the opening and the end of reasoning, neither counted. At the budget
    the engine makes the model write `forced` (the family's end of reasoning), and the model goes on to answer.
    Engines: the local one forces the tokens itself; an upstream gets its own budget where it has one, and
    Deltafin stops and resumes a generation that runs past it (deltafin.engine.text.reasoning_budget)."""

    tokens: int
    #: what ends reasoning, as text (the end marker, and anything else the parser ends reasoning at)
    ends: tuple[str, ...]
    #: the ids forced at the budget: the family's end of reasoning (`forced_text`), tokenized as the model writes it
    forced: tuple[int, ...]
    forced_text: str
    #: how the prompt opened reasoning (its output starts inside it); None: it did not
    opened: str | None = None
    #: what opens reasoning when the model opens it itself (the prompt left that to it); None: it cannot
    start: str | None = None
    #: the constraint the generation continues under once reasoning ended, for an engine that resumes a
    #: generation in a new request (the request's constraint, after the forced end); None: unconstrained
    resume: Constraint | None = None


@dataclass(frozen=True)
class SamplingParams:
    """Everything that decides which tokens come out; hashable so identical requests can be memoized."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    # Logprobs of the prompt's own tokens (completions with echo + logprobs); None = not asked.
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    # Constrained decoding (response_format, enforced tool_choice); None = free generation.
    constraint: Constraint | None = None
    # A cap on the reasoning tokens (thinking_token_budget); None = reasoning runs as long as the model likes.
    reasoning_budget: ReasoningBudget | None = None
    extra: tuple[tuple[str, object], ...] = field(default=())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def deterministic(self) -> bool:
        """Greedy or seeded: the same prompt and parameters always give the same tokens."""
        return self.greedy or self.seed is not None


#: the request fields a model's default sampling may fill (SamplingFields' names), in the order /v1/models shows them
DEFAULTABLE = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
)


@dataclass(frozen=True)
class SamplingDefaults:
    """A served model's default sampling: the value of each field a request leaves out (None: OpenAI's default).

    `max_tokens` is a default, not a request: a prompt that leaves less room gets the room that is left instead of
    a context-length error (the request plan's default token budget, which the compat rules may change). `sources` says where each
    value came from (`generation_config.json` or `model.sampling`), for the load log line."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None
    sources: tuple[tuple[str, str], ...] = ()

    def values(self) -> dict[str, float | int]:
        """The fields that have a default, by name (what /v1/models shows)."""
        return {name: value for name in DEFAULTABLE if (value := getattr(self, name)) is not None}


NO_DEFAULTS = SamplingDefaults()
