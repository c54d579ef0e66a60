"""Compiling constraints against a tokenizer, cached: the same schema for the same tokenizer compiles once.

`GrammarCache` owns one xgrammar compiler per tokenizer and an LRU of compiled grammars keyed on
(constraint, tokenizer key). `constraint_factory` is what the local engine is given
(`LocalEngine(..., constraint_factory=...)`): Constraint -> a fresh per-row matcher over the cached grammar.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterable

import structlog
import xgrammar as xgr

from deltafin.grammar.constraints import grammar_of
from deltafin.engine.constraint import RowConstraint
from deltafin.grammar.row import XGrammarRow
from deltafin.protocol.sampling import Constraint

log = structlog.get_logger("deltafin.grammar")


def logits_width(model: Any) -> int:
    """The width of the model's logits, which the bitmask must cover (often past the tokenizer's own size)."""
    head = model.get_output_embeddings()
    # out_features first: a head of GGUF blocks (deltafin.engine.qlinear.GGMLLinear) has no float weight
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


def tokenizer_key(tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> Hashable:
    """What makes two tokenizers give the same compiled grammar: vocabulary, logits width and stop ids."""
    return (getattr(tokenizer, "name_or_path", ""), len(tokenizer), vocab_size, tuple(sorted(stop_token_ids)))


class GrammarCache:
    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        self._compilers: dict[Hashable, xgr.GrammarCompiler] = {}
        self._compiled: OrderedDict[tuple[Constraint, Hashable], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # engine thread and tests may compile at once
        self.hits = 0
        self.misses = 0

    def compiler(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]
    ) -> tuple[Hashable, xgr.GrammarCompiler]:
        stops = sorted(stop_token_ids)
        key = tokenizer_key(tokenizer, vocab_size, stops)
        with self._lock:
            compiler = self._compilers.get(key)
            if compiler is None:
                # The engine's stop ids (not only the tokenizer's eos) are what may end a constrained row.
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
                compiler = self._compilers[key] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return key, compiler

    def compile(
        self, constraint: Constraint, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]
    ) -> xgr.CompiledGrammar:
        key, compiler = self.compiler(tokenizer, vocab_size, stop_token_ids)
        entry = (constraint, key)
        with self._lock:
            compiled = self._compiled.get(entry)
            if compiled is not None:
                self._compiled.move_to_end(entry)
                self.hits += 1
                return compiled
        started = time.perf_counter()
        compiled = compiler.compile_grammar(grammar_of(constraint))
        log.debug("grammar_compiled", kind=constraint.kind, seconds=round(time.perf_counter() - started, 4))
        with self._lock:
            self.misses += 1
            self._compiled[entry] = compiled
            while len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        return compiled


def constraint_factory(
    tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], cache: GrammarCache | None = None
) -> Callable[[Constraint], RowConstraint]:
    """Constraint -> a new RowConstraint for one row (matchers are stateful; compiled grammars are shared)."""
    cache = GrammarCache() if cache is None else cache
    stops = tuple(sorted(stop_token_ids))

    def make(constraint: Constraint) -> RowConstraint:
        return XGrammarRow(cache.compile(constraint, tokenizer, vocab_size, stops), vocab_size)

    make.cache = cache  # type: ignore[attr-defined]  # tests and the bench read hit counts
    return make
