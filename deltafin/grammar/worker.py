"""The grammar worker process: checks and compiles constraints, one at a time, for `deltafin.grammar.workers`.

A compile is CPU work of unbounded cost (a hostile schema can take minutes) inside xgrammar's C++, which no
thread can interrupt; a process can be killed. The worker is forked from multiprocessing's fork server, which
has imported this module (and xgrammar) once, so a replacement starts in milliseconds.

Over its pipe (bytes messages):
- first, from the parent: the serialized `xgrammar.TokenizerInfo`, or empty (check only: a gateway, whose
  upstream compiles); the worker builds its compiler, warms it up and answers `READY`;
- then requests `kind NUL value` (a `Constraint`), each answered `OK` + the serialized `CompiledGrammar` (empty
  when checking only), or `INVALID` / `TOO_COMPLEX` (over a structural limit) + a one-line reason.
The worker also arms an alarm per request (`timeout_s` + a margin) so that it dies by itself if the parent,
which normally kills it at the budget, is gone.
"""

from __future__ import annotations

import signal
from typing import Any

import xgrammar as xgr

from deltafin.grammar.constraints import grammar_of, readable
from deltafin.grammar.limits import TooComplex, check_limits
from deltafin.protocol.sampling import Constraint

READY, OK, INVALID, TOO_COMPLEX = b"R", b"O", b"E", b"T"
#: a worker outliving its budget by this much kills itself (the parent kills it at the budget)
SELF_KILL_MARGIN_S = 2.0


def encode_request(constraint: Constraint) -> bytes:
    return constraint.kind.encode() + b"\0" + constraint.value.encode("utf-8")


def decode_request(data: bytes) -> Constraint:
    kind, _, value = data.partition(b"\0")
    return Constraint(kind.decode(), value.decode("utf-8"))


def make_compiler(tokenizer_info: xgr.TokenizerInfo) -> xgr.GrammarCompiler:
    # One thread: a worker is one lane of compile work; the lanes are the parallelism.
    return xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)


def build(constraint: Constraint, compiler: xgr.GrammarCompiler | None) -> xgr.CompiledGrammar | None:
    """Limits, then xgrammar's grammar, then (with a compiler) the compiled grammar; ValueError when any
    step refuses. The same steps whether run here or in-process (tests, benchmarks)."""
    check_limits(constraint)
    grammar = grammar_of(constraint)
    if compiler is None:
        return None
    try:
        return compiler.compile_grammar(grammar)
    except Exception as exc:  # xgrammar's own errors carry a readable first line
        raise ValueError(readable(exc)) from exc


def answer(request: bytes, compiler: xgr.GrammarCompiler | None) -> bytes:
    try:
        compiled = build(decode_request(request), compiler)
    except ValueError as exc:
        status = TOO_COMPLEX if isinstance(exc, TooComplex) else INVALID
        return status + str(exc).encode("utf-8", "replace")
    return OK + (compiled.serialize_json().encode("utf-8") if compiled is not None else b"")


def serve(conn: Any, timeout_s: float) -> None:
    """The worker's main loop (the multiprocessing target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    info = conn.recv_bytes()
    compiler = make_compiler(xgr.TokenizerInfo.deserialize_json(info.decode("utf-8"))) if info else None
    if compiler is not None:
        compiler.compile_builtin_json_grammar()  # the first compile builds per-tokenizer tables: not on a request
    conn.send_bytes(READY)
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            return
        signal.setitimer(signal.ITIMER_REAL, timeout_s + SELF_KILL_MARGIN_S)  # SIGALRM's default: terminate
        reply = answer(request, compiler)
        signal.setitimer(signal.ITIMER_REAL, 0)
        conn.send_bytes(reply)
