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
    extra: tuple[tuple[str, object], ...] = field(default=())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def deterministic(self) -> bool:
        """Greedy or seeded: the same prompt and parameters always give the same tokens."""
        return self.greedy or self.seed is not None
