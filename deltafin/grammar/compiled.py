"""Compiled grammars as the local engine receives them: `ReadyGrammar` gives each row its own matcher.

The engine never compiles: a job's `grammar` arrives ready (`deltafin.grammar.service` compiles in worker
processes). `tokenizer_info` is what xgrammar needs per tokenizer (built once, at start-up);
`compile_now` compiles in the calling thread, for tests and benchmarks only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from deltafin.grammar.row import XGrammarRow
from deltafin.grammar.worker_process import build, compile_grammar, make_compiler
from deltafin.protocol.sampling import Constraint


def logits_width(model: Any) -> int:
    """The width of the model's logits, which the bitmask must cover (often past the tokenizer's own size)."""
    head = model.get_output_embeddings()
    # out_features first: a head of GGUF blocks (deltafin.engine.quant.linear.GGMLLinear) has no float weight
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> xgr.TokenizerInfo:
    """The engine's stop ids (not only the tokenizer's eos) are what may end a constrained row."""
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))


@dataclass(frozen=True, eq=False)
class ReadyGrammar:
    """A grammar compiled for the engine's tokenizer (deltafin.engine.local.matcher.MatcherSource)."""

    compiled: xgr.CompiledGrammar
    vocab_size: int

    def matcher(self) -> XGrammarRow:
        """A fresh matcher for one row (matchers are stateful; the compiled grammar is shared)."""
        return XGrammarRow(self.compiled, self.vocab_size)


def compile_now(constraint: Constraint, info: xgr.TokenizerInfo, vocab_size: int) -> ReadyGrammar:
    """Compile in this thread, unbounded: for tests and benchmarks, never for a request."""
    compiler = make_compiler(info)
    return ReadyGrammar(compile_grammar(compiler, build(constraint, None)), vocab_size)
