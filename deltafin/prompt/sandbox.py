"""A time and size budget for chat-template rendering, the model's template and (when trusted) a request's.

Jinja templates run in transformers' ImmutableSandboxedEnvironment, which stops attribute escapes but not a
template that loops for minutes or builds a gigabyte string. Three bounds close that:

- time: the render runs under a watchdog that raises `TemplateTimeout` inside the rendering thread when the
  budget is spent (compiled templates are Python code, so a loop is interrupted at its next bytecode);
- size: `*` and `**` in templates are intercepted (a C-level `"x" * 10**10` could not be interrupted), and
  the rendered text is measured before anything is tokenized;
- failures jinja's sandbox raises as plain Python errors (`range(10**8)` is an OverflowError, deep nesting a
  RecursionError) become 400s naming the template, like any template that rejects its input.

The template sees the real messages (deltafin.prompt.template), so its time grows with the prompt: string work
over a body of `server.max_body_bytes` takes milliseconds, far inside the budget; tokenizing stays outside it.
"""

from __future__ import annotations

import ctypes
import heapq
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

from deltafin.errors import InvalidRequestError


@dataclass(frozen=True)
class TemplateBudget:
    timeout_s: float = 2.0
    max_chars: int = 8 * 1024 * 1024


_budget: ContextVar[TemplateBudget] = ContextVar(
    "deltafin_template_budget",
    default=TemplateBudget(),  # noqa: B039 (frozen: never mutated)
)


@contextmanager
def template_budget(budget: TemplateBudget) -> Iterator[None]:
    """Renders inside this block (on this thread) use `budget`."""
    token = _budget.set(budget)
    try:
        yield
    finally:
        _budget.reset(token)


class TemplateTimeout(BaseException):
    """Raised asynchronously in the rendering thread; a BaseException so template code cannot swallow it."""


def render_bounded(render: Callable[[], str]) -> str:
    """`render()` within the current budget; over time or size is a 400 (`param` chat_template)."""
    budget = _budget.get()
    try:
        with _watchdog(budget.timeout_s):
            text = render()
    except TemplateTimeout:
        raise InvalidRequestError(
            f"the chat template did not finish rendering within {budget.timeout_s} s", param="chat_template"
        ) from None
    except (OverflowError, RecursionError, MemoryError) as exc:
        raise InvalidRequestError(f"the chat template exceeded its limits: {exc}", param="chat_template") from None
    if len(text) > budget.max_chars:
        raise InvalidRequestError(
            f"the chat template rendered {len(text)} characters (limit {budget.max_chars})", param="chat_template"
        )
    return text


@contextmanager
def _watchdog(timeout_s: float) -> Iterator[None]:
    """Raise TemplateTimeout in this thread if the block runs past `timeout_s`. The lock makes "fired" and
    "finished" exclusive, and a timeout still pending when the block ends is withdrawn, so it never lands in
    whatever the thread runs next."""
    thread_id = threading.get_ident()
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def fire() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                _set_async_exc(thread_id, TemplateTimeout)

    alarm = _ALARMS.arm(timeout_s, fire)
    try:
        yield
    finally:
        with lock:
            state["done"] = True
            if state["fired"]:
                _set_async_exc(thread_id, None)
        alarm.cancelled = True


class _Alarm:
    __slots__ = ("due", "fire", "cancelled")

    def __init__(self, due: float, fire: Callable[[], None]) -> None:
        self.due = due
        self.fire = fire
        self.cancelled = False

    def __lt__(self, other: _Alarm) -> bool:
        return self.due < other.due


class _Alarms:
    """Every render's deadline on one daemon thread: a `threading.Timer` per render (a new thread each time)
    cost about 0.1 ms of CPU per request, more than most renders. A cancelled alarm is only marked; the thread
    drops it when it comes first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[_Alarm] = []
        self._thread: threading.Thread | None = None

    def arm(self, timeout_s: float, fire: Callable[[], None]) -> _Alarm:
        alarm = _Alarm(time.monotonic() + timeout_s, fire)
        with self._cond:
            heapq.heappush(self._heap, alarm)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="deltafin-template-watchdog", daemon=True)
                self._thread.start()
            elif self._heap[0] is alarm:
                self._cond.notify()  # an earlier deadline than the one being waited for
        return alarm

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0].cancelled:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0].due - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap).fire()


_ALARMS = _Alarms()


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


class BoundedSandboxedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox plus bounds on the two operators that can allocate without limit in one step."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        limit = _budget.get().max_chars
        if operator == "**" and isinstance(right, int) and abs(right) > 64 and isinstance(left, int) and abs(left) > 1:
            raise InvalidRequestError("the chat template raised a number to too large a power", param="chat_template")
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and len(seq) * count > limit:
                    raise InvalidRequestError(
                        "the chat template built a value larger than its size limit", param="chat_template"
                    )
        return super().call_binop(context, operator, left, right)


def _install() -> None:
    """Make transformers compile chat templates with the bounded environment (the environment is chosen when a
    template is compiled, so this must happen before the first render)."""
    try:
        from transformers.utils import chat_template_utils
    except ImportError:  # pragma: no cover - transformers is a dependency; the time budget still applies
        return
    if getattr(chat_template_utils, "ImmutableSandboxedEnvironment", None) is ImmutableSandboxedEnvironment:
        # a module attribute of transformers' (pinned by tests/prompt/test_sandbox*.py), not a type we define
        chat_template_utils.ImmutableSandboxedEnvironment = BoundedSandboxedEnvironment  # type: ignore[misc]  # a module attribute of transformers' (see above), not a type we define
        chat_template_utils._compile_jinja_template.cache_clear()


_install()
