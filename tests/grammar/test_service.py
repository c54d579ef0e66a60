"""Grammars: constraints checked and compiled in worker processes, bounded by limits and a time budget, outcomes
cached both ways, on the default model's tokenizer."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from deltafin.engine.weights.tokenizer_only import load_tokenizer_only
from deltafin.errors import EngineBusyError
from deltafin.grammar import limits
from deltafin.grammar.compiled import ReadyGrammar, tokenizer_info
from deltafin.grammar.constraints import json_object, json_schema, structural_tag
from deltafin.grammar.lanes import WORKER_NICENESS, FairQueue, WorkerLost, default_workers
from deltafin.grammar.limits import TooComplex, check_limits
from deltafin.grammar.service import Grammars


def prop(schema: dict) -> dict:
    return {"type": "object", "properties": {"a": schema}, "required": ["a"]}


def nested(depth: int, leaf: dict | None = None) -> dict:
    schema = leaf or {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


#: under every structural limit (260 KB), and far too slow to compile: xgrammar's cost grows about
#: quadratically with optional properties (5000 took 5 s, 10000 more than 20 s)
SLOW = json_schema({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10000)}})


@pytest.fixture(scope="module")
def info(config):
    bundle = load_tokenizer_only(config.model)
    return tokenizer_info(bundle.tokenizer, bundle.vocab_size, bundle.stop_token_ids), bundle.vocab_size


@pytest.fixture(scope="module")
def grammars(info):
    service = Grammars(*info, workers=2, timeout_s=1.5)
    yield service
    service.close()


def run(coro):
    return asyncio.run(coro)


def timed(coro) -> tuple[object, float]:
    async def go():
        started = time.perf_counter()
        try:
            value = await coro
        except Exception as exc:  # the caller looks at it
            value = exc
        return value, time.perf_counter() - started

    return run(go())


class TestLimits:
    @pytest.mark.parametrize(
        "schema, says",
        [
            (prop({"type": "string", "pattern": "^[a-z]{12000}$"}), "repeats 12000 times"),
            (prop({"type": "string", "pattern": "^(ab){5,1001}$"}), "repeats 1001 times"),
            ({"type": "object", "patternProperties": {"^x{2000}$": {}}}, "repeats 2000 times"),
            (
                {
                    "type": "object",
                    "properties": {f"p{i}": {"type": "string", "pattern": "^a{900}$"} for i in range(12)},
                },
                "in all",
            ),
            (nested(400), "nested more than"),
            (nested(300, {"$ref": "#/$defs/missing"}), "nested more than"),
        ],
    )
    def test_hostile_shapes_are_refused_before_any_compile(self, schema, says):
        started = time.perf_counter()
        with pytest.raises(TooComplex, match=says):
            check_limits(json_schema(schema))
        # Generous: the limits walk the schema in milliseconds, while xgrammar takes minutes on these shapes; 10 s
        # leaves room for a loaded two-core machine and still fails if a compile had started.
        assert time.perf_counter() - started < 10

    def test_real_schemas_pass(self):
        check_limits(json_schema(prop({"type": "string", "pattern": r"^\d{3}-\d{4}$", "maxLength": 100000})))
        check_limits(json_schema(nested(40)))
        check_limits(json_object())
        check_limits(structural_tag({"type": "structural_tag", "format": {"type": "regex", "pattern": "[0-9]{1,4}"}}))

    def test_a_huge_constraint_is_refused_by_size(self):
        big = {
            "type": "object",
            "properties": {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(6000)},
        }
        with pytest.raises(TooComplex, match="larger than"):
            check_limits(json_schema(big))
        assert len(json.dumps(big)) > limits.MAX_CONSTRAINT_BYTES


class TestPrepare:
    def test_a_schema_compiles_once_and_concurrent_requests_share_it(self, grammars):
        schema = json_schema(prop({"type": "integer", "minimum": 3}))
        sent = grammars.workers.sent

        async def three():
            return await asyncio.gather(*(grammars.prepare(schema) for _ in range(3)))

        results = run(three())
        assert all(isinstance(ready, ReadyGrammar) for ready, _ in results)
        assert len({id(ready) for ready, _ in results}) == 1 and grammars.workers.sent == sent + 1
        (again, ran), took = timed(grammars.prepare(schema))
        assert again is results[0][0] and ran == 0.0 and grammars.workers.sent == sent + 1  # from the cache
        matcher = again.matcher()
        assert not matcher.is_terminated() and again.matcher() is not matcher  # a fresh matcher per row

    def test_an_invalid_schema_is_refused_and_the_refusal_cached(self, grammars):
        bad = json_schema(prop({"type": "no-such-type"}))
        sent = grammars.workers.sent
        error, _ = timed(grammars.prepare(bad))
        assert isinstance(error, ValueError) and not isinstance(error, TooComplex)
        assert "no-such-type" in str(error) and "/project/" not in str(error)  # no C++ source location
        for _ in range(5):  # resent: answered from the cache, no worker involved
            again, _ = timed(grammars.prepare(bad))
            assert type(again) is type(error) and str(again) == str(error)
        assert grammars.workers.sent == sent + 1

    def test_over_a_limit_is_too_complex_at_once(self, grammars):
        error, took = timed(grammars.prepare(json_schema(prop({"type": "string", "pattern": "^[a-z]{12000}$"}))))
        assert isinstance(error, TooComplex) and took < 2

    def test_a_compile_past_the_budget_is_killed_replaced_and_remembered(self, grammars):
        replaced, pids = grammars.workers.replaced, set(grammars.workers.pids())
        error, took = timed(grammars.prepare(SLOW))
        assert isinstance(error, TooComplex) and "longer than 1.5 s" in str(error)
        assert took < 1.5 + 2  # the budget, then the answer (not the minutes the compile would take)
        for _ in range(100):  # the lane answers first, then replaces its worker
            now = set(grammars.workers.pids())
            if len(now) == 2 and now != pids:
                break
            time.sleep(0.05)
        assert grammars.workers.replaced == replaced + 1
        gone = pids - set(grammars.workers.pids())
        assert len(gone) == 1
        time.sleep(0.2)
        assert _zombie_or_gone(gone)  # killed, not left burning a core
        sent = grammars.workers.sent
        again, _ = timed(grammars.prepare(SLOW))
        # the refusal is cached like a success: no worker compiles it again
        assert isinstance(again, TooComplex) and grammars.workers.sent == sent
        ready, _ = run(grammars.prepare(json_schema(prop({"type": "boolean"}))))  # the new worker serves
        assert isinstance(ready, ReadyGrammar)

    def test_a_compiled_grammar_over_the_size_limit_is_too_complex(self, info, monkeypatch):
        # A 500 KB enum of 40000 values compiles to 114 MiB; here the limit comes down to a usual grammar's size.
        from deltafin.grammar import worker_process as worker

        monkeypatch.setattr(worker, "MAX_COMPILED_BYTES", 1 << 20)
        with pytest.raises(TooComplex, match="compiled grammar would take 2 MiB"):
            worker.build(json_object(), worker.make_compiler(info[0]))

    def test_a_request_that_gets_no_worker_by_its_deadline_is_429_and_its_compile_dropped(self, info):
        service = Grammars(*info, workers=1, timeout_s=2.0)
        try:

            async def scenario():
                hostile = asyncio.ensure_future(service.prepare(SLOW))
                await asyncio.sleep(0.3)  # the one worker is busy with it
                waiting = json_schema(prop({"type": "string", "enum": ["queued"]}))
                with pytest.raises(EngineBusyError):
                    await service.prepare(waiting, deadline=time.monotonic() + 0.3)
                with pytest.raises(TooComplex):
                    await hostile
                await asyncio.sleep(0.3)
                return service.workers.sent

            assert run(scenario()) == 1  # the refused request's compile never reached the worker
        finally:
            service.close()

    def test_check_only_runs_the_limits_and_the_schema_but_compiles_nothing(self, info):
        service = Grammars(None, info[1], workers=1, timeout_s=5.0)
        try:
            assert run(service.prepare(json_schema(prop({"type": "string"})))) == (None, pytest.approx(0, abs=5))
            with pytest.raises(ValueError, match="no-such-type"):
                run(service.prepare(json_schema(prop({"type": "no-such-type"}))))
            with pytest.raises(TooComplex):
                run(service.prepare(json_schema(nested(400))))
        finally:
            service.close()

    def test_the_event_loop_keeps_ticking_while_a_worker_compiles(self, grammars):
        """Counted, not timed: a loop that sleeps 5 ms per tick ticks many times during a compile in a worker
        process, and not at all if the compile blocked it."""

        async def scenario():
            ticks = 0
            task = asyncio.ensure_future(
                grammars.prepare(
                    json_schema({"type": "object", "properties": {f"q{i}": {"type": "string"} for i in range(300)}})
                )
            )  # about 0.3 s of compile (well inside the 1.5 s budget on a busy machine too)
            while not task.done():
                await asyncio.sleep(0.005)
                ticks += 1
            ready, _ = await task
            return isinstance(ready, ReadyGrammar), ticks

        compiled, ticks = run(scenario())
        assert compiled and ticks >= 10, ticks


def _zombie_or_gone(pids: set[int]) -> bool:
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as status:
                if "zombie" not in status.read():
                    return False
        except FileNotFoundError:
            pass
    return True


class TestSharing:
    """The worker pool under load: shared fairly between API keys, a core left for decoding, and a worker killed
    from outside a retryable 503, never a 400 (12 distinct slow schemas of one key made a legitimate schema wait
    32.7 s and a stream stall 2.5 s)."""

    def test_keys_take_turns_whatever_one_key_queued(self):
        queue = FairQueue()
        for i in range(4):
            queue.put("mallory", f"m{i}")
        queue.put("alice", "a0")
        queue.put("bob", "b0")
        queue.put("mallory", "m4")
        queue.put("alice", "a1")
        assert [queue.get() for _ in range(8)] == ["m0", "a0", "b0", "m1", "a1", "m2", "m3", "m4"]

    def test_a_keys_schema_is_compiled_after_at_most_one_of_anothers(self, info):
        """One lane, another key's four slow schemas queued first: the fifth key's schema is next but one."""
        service = Grammars(*info, workers=1, timeout_s=30.0)
        finished: list[str] = []
        try:

            async def one(owner: str, name: str, schema):
                await service.prepare(schema, owner=owner)
                finished.append(name)

            async def scenario():
                slow = [
                    json_schema({"type": "object", "properties": {f"p{i}_{k}": {"type": "string"} for i in range(600)}})
                    for k in range(4)
                ]
                tasks = [asyncio.ensure_future(one("mallory", f"slow{k}", s)) for k, s in enumerate(slow)]
                await asyncio.sleep(0.05)
                tasks.append(asyncio.ensure_future(one("alice", "alice", json_schema(prop({"type": "boolean"})))))
                await asyncio.gather(*tasks)

            run(scenario())
        finally:
            service.close()
        assert finished.index("alice") <= 1, finished  # FIFO made it last

    def test_workers_leave_a_core_for_decoding(self, monkeypatch):
        monkeypatch.setattr(os, "cpu_count", lambda: 2)
        assert default_workers() == 1
        monkeypatch.setattr(os, "cpu_count", lambda: 16)
        assert default_workers() == 15

    def test_worker_processes_run_below_the_servers_priority(self, grammars):
        assert all(os.getpriority(os.PRIO_PROCESS, pid) >= WORKER_NICENESS for pid in grammars.workers.pids())

    def test_a_worker_killed_from_outside_is_a_retryable_failure(self, info):
        service = Grammars(*info, workers=1, timeout_s=30.0)
        try:

            async def scenario():
                task = asyncio.ensure_future(service.prepare(SLOW))
                while service.workers.sent == 0:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)
                (pid,) = service.workers.pids()
                os.kill(pid, signal.SIGKILL)  # the OOM killer, an operator
                with pytest.raises(WorkerLost):
                    await task
                # not cached as the schema's fault: the next request compiles on a fresh worker
                ready, _ = await service.prepare(json_schema(prop({"type": "boolean"})))
                return ready

            assert isinstance(run(scenario()), ReadyGrammar)
        finally:
            service.close()

    def test_a_schema_that_kills_workers_twice_in_a_row_is_refused(self, info):
        """A retry is worth it once; a constraint on which the compiler dies again is the constraint's fault."""
        service = Grammars(*info, workers=1, timeout_s=30.0)
        try:

            async def attempt():
                task = asyncio.ensure_future(service.prepare(SLOW))
                sent = service.workers.sent
                while service.workers.sent == sent:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)  # inside the compile
                for pid in service.workers.pids():
                    os.kill(pid, signal.SIGKILL)
                return (await asyncio.gather(task, return_exceptions=True))[0]

            first, second = run(attempt()), run(attempt())
            third, _ = timed(service.prepare(SLOW))  # cached: no third worker dies for it
        finally:
            service.close()
        assert isinstance(first, WorkerLost) and isinstance(second, ValueError) and not isinstance(second, WorkerLost)
        assert "grammar compiler" in str(second) and type(third) is type(second)
