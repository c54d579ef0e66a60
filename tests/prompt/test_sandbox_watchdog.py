"""The template watchdog: one shared thread holds every render's deadline, fires on time, never late, never
after the render ended."""

from __future__ import annotations

import threading
import time

import pytest

from deltafin.prompt.sandbox import TemplateTimeout, _watchdog


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_a_render_past_its_budget_is_interrupted():
    started = time.monotonic()
    with pytest.raises(TemplateTimeout):
        with _watchdog(0.1):
            spin(5)
    # Interrupted long before the render's own end (how late after 0.1 s depends on the machine's load: the
    # watchdog thread needs the GIL from a spinning thread, and the suite runs two workers on two cores).
    assert time.monotonic() - started < 4


def test_a_shorter_deadline_armed_later_fires_before_a_longer_one():
    outcome: list[float] = []

    def short_render() -> None:
        began = time.monotonic()
        try:
            with _watchdog(0.1):
                spin(5)
        except TemplateTimeout:
            outcome.append(time.monotonic() - began)

    with _watchdog(30):  # the shared thread is now waiting for a deadline 30 s away
        worker = threading.Thread(target=short_render)
        worker.start()
        worker.join(5)
    # Fired at the short deadline, not the shared thread's 30 s one, and long before the render's own end
    # (the exact lateness is the machine's load: see above).
    assert outcome and outcome[0] < 4


def test_a_finished_render_is_never_interrupted_afterwards():
    for _ in range(50):
        with _watchdog(0.01):
            pass
    spin(0.1)  # every deadline above has passed; none may land here
