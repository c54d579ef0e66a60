"""The README's client example, as written (its code block, only the address is the test server's), against the
default model: a request without sampling fields is served at the model's own defaults (SmolLM2's model card:
temperature 0.2, top-p 0.9), and answers the README's question sensibly each time."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def readme_example() -> str:
    """The README's first Python block."""
    (block, *_) = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    return block


def test_the_example_asks_without_sampling_fields():
    code = readme_example()
    assert "What is the capital of France? One word." in code and "temperature" not in code


def test_the_readme_example_answers_paris_three_times(live_server):
    code = readme_example().replace("http://127.0.0.1:8000", live_server.base_url)
    answers = []
    for _ in range(3):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "README.md", "exec"), {})  # noqa: S102 (the README's own code)
        answers.append(printed.getvalue().strip())
    assert all("Paris" in answer for answer in answers), answers
    assert all(len(answer) < 200 for answer in answers), answers  # an answer, not a ramble to max_tokens
