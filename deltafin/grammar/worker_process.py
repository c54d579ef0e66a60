"""The grammar worker process: proves constraints, one at a time, for `deltafin.grammar.lanes`.

xgrammar's work on a constraint is CPU work of unbounded cost inside C++ (a hostile schema takes minutes),
which no thread can interrupt; a process can be killed. So each constraint is first taken through every step
here, under the time budget: the structural limits, xgrammar's reading of it (`Grammar`), and, with a
tokenizer, a trial compile whose size is checked too. What comes back is the `Grammar`, serialized (kilobytes):
the parent compiles it again on a lane thread (xgrammar releases the GIL there), work now known to finish
within the budget. A compiled grammar itself is not sent: it is megabytes of JSON (3.8 MB for `{"type":
"object"}` on SmolLM2's vocabulary, 636 MB for 1000 optional properties), whose serializing and reading
back cost far more than the compile and hold the GIL for seconds.

The worker is forked from multiprocessing's fork server, which has imported this module (and xgrammar) once,
so a replacement starts in milliseconds. Over its pipe (bytes messages):
- first, from the parent: the serialized `xgrammar.TokenizerInfo`, or empty (check only: a gateway, whose
  upstream compiles); the worker builds its compiler, warms it up and answers `READY`;
- then requests `kind NUL value` (a `Constraint`), each answered `OK` + `Grammar.serialize_json()`, or
  `INVALID` / `TOO_COMPLEX` (over a limit) + a one-line reason.
The worker arms an alarm per request (`timeout_s` + a margin), so that it dies by itself if the parent, which
normally kills it at the budget, is gone; and it may not grow its heap by more than `HEAP_GROWTH_BYTES`.
"""

from __future__ import annotations

import os
import resource
import signal
from typing import Any

import xgrammar as xgr

from deltafin.grammar.constraints import grammar_of, readable
from deltafin.grammar.limits import TooComplex, check_limits
from deltafin.protocol.sampling import Constraint

READY, OK, INVALID, TOO_COMPLEX = b"R", b"O", b"E", b"T"
#: a worker outliving its budget by this much kills itself (the parent kills it at the budget)
SELF_KILL_MARGIN_S = 2.0
#: a compiled grammar larger than this is refused: ~25x what a JSON schema takes on a 49k vocabulary (2.6 MB),
#: while a hostile one takes hundreds (and every cached grammar is held in the server's memory)
MAX_COMPILED_BYTES = 64 * 1024 * 1024
#: how far a worker's heap may grow past what it had at start-up (malloc fails past it, the request is refused)
HEAP_GROWTH_BYTES = 2 * 1024 * 1024 * 1024
#: how far below the server's priority a worker runs: decoding keeps the cores it needs while schemas compile
WORKER_NICENESS = 10


def encode_request(constraint: Constraint) -> bytes:
    return constraint.kind.encode() + b"\0" + constraint.value.encode("utf-8")


def decode_request(data: bytes) -> Constraint:
    kind, _, value = data.partition(b"\0")
    return Constraint(kind.decode(), value.decode("utf-8"))


def make_compiler(tokenizer_info: xgr.TokenizerInfo) -> xgr.GrammarCompiler:
    # One thread: a worker is one lane of compile work; the lanes are the parallelism.
    return xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)


def compile_grammar(compiler: xgr.GrammarCompiler, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
    try:
        return compiler.compile_grammar(grammar)
    except MemoryError:
        raise TooComplex("compiling it needs too much memory") from None
    except Exception as exc:  # xgrammar's own errors carry a readable first line
        raise ValueError(readable(exc)) from exc


def build(constraint: Constraint, compiler: xgr.GrammarCompiler | None) -> xgr.Grammar:
    """Limits, then xgrammar's grammar, then (with a compiler) a trial compile and its size; ValueError
    (TooComplex past a limit) when any step refuses. The same steps whether run here or in-process (tests)."""
    check_limits(constraint)
    grammar = grammar_of(constraint)
    if compiler is not None:
        size = compile_grammar(compiler, grammar).memory_size_bytes
        if size > MAX_COMPILED_BYTES:
            raise TooComplex(
                f"its compiled grammar would take {size // 2**20} MiB (at most {MAX_COMPILED_BYTES // 2**20} MiB)"
            )
    return grammar


def answer(request: bytes, compiler: xgr.GrammarCompiler | None) -> bytes:
    try:
        grammar = build(decode_request(request), compiler)
    except ValueError as exc:
        status = TOO_COMPLEX if isinstance(exc, TooComplex) else INVALID
        return status + str(exc).encode("utf-8", "replace")
    except MemoryError:
        return TOO_COMPLEX + b"reading it needs too much memory"
    return OK + grammar.serialize_json().encode("utf-8")


def _limit_heap() -> None:
    with open("/proc/self/status") as status:
        data_kb = next(int(line.split()[1]) for line in status if line.startswith("VmData:"))
    limit = data_kb * 1024 + HEAP_GROWTH_BYTES
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def serve(conn: Any, timeout_s: float) -> None:
    """The worker's main loop (the multiprocessing target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    try:
        os.nice(WORKER_NICENESS)
    except OSError:  # not allowed here: the workers still run, at the server's priority
        pass
    info = conn.recv_bytes()
    compiler = make_compiler(xgr.TokenizerInfo.deserialize_json(info.decode("utf-8"))) if info else None
    if compiler is not None:
        compiler.compile_builtin_json_grammar()  # the first compile builds per-tokenizer tables: not on a request
    try:
        _limit_heap()
    except (OSError, ValueError, StopIteration):  # no /proc, or the limit cannot be set: the time budget remains
        pass
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
