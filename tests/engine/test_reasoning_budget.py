"""deltafin.engine.text.reasoning_budget: one choice's reasoning counted against its budget, token by token, over a
made-up vocabulary (id -> text), so each case states exactly which tokens count."""

from __future__ import annotations

import pytest

from deltafin.engine.text.reasoning_budget import COUNTING, DONE, FORCING, IDLE, ReasoningTracker
from deltafin.protocol.sampling import ReasoningBudget

VOCAB = {
    1: "a",
    2: "b",
    3: "</think>",
    4: "<",
    5: "/think",
    6: ">",
    7: "<think>",
    8: "\n",
    9: "<tool_call>",
    10: "<|close|>",
    11: "think",
    12: "<|sep|>",
    13: "<|open|>",
    14: "response",
    15: " x</think>y",
}
THINK = {"ends": ("</think>", "<tool_call>"), "forced": (3,), "forced_text": "</think>"}
K3 = {"ends": ("<|close|>think<|sep|>",), "forced": (10, 11, 12, 13, 14, 12), "forced_text": "..."}


def tracker(tokens: int, *, opened: bool = True, start: str | None = None, markers=THINK) -> ReasoningTracker:
    budget = ReasoningBudget(tokens=tokens, opened="<think>" if opened else None, start=start, **markers)
    return ReasoningTracker(budget, VOCAB.__getitem__)


def run(t: ReasoningTracker, sampled: list[int]) -> list[int]:
    """What a local row writes: the forced id where there is one, else the next sampled one."""
    written, pending = [], list(sampled)
    while pending or t.next_forced() is not None:
        forced = t.next_forced()
        token = forced if forced is not None else pending.pop(0)
        t.observe(token)
        written.append(token)
        if t.state == DONE and not pending:
            break
    return written


class TestCounting:
    def test_at_the_budget_the_end_is_forced(self):
        t = tracker(3)
        assert run(t, [1, 2, 1, 2, 2]) == [1, 2, 1, 3, 2, 2]
        assert t.tokens == 3 and t.state == DONE

    def test_a_budget_of_zero_ends_reasoning_at_once(self):
        t = tracker(0)
        assert t.next_forced() == 3
        assert run(t, [1]) == [3, 1] and t.tokens == 0

    def test_an_end_the_model_writes_itself_does_not_count(self):
        t = tracker(10)
        assert run(t, [1, 2, 3, 1, 1]) == [1, 2, 3, 1, 1] and t.tokens == 2 and t.state == DONE

    def test_an_end_spelled_in_pieces_ends_it_as_the_parser_reads_it(self):
        t = tracker(10)
        for token in [1, 4, 5, 6]:
            t.observe(token)
        assert t.state == DONE and t.tokens == 1

    def test_a_token_holding_the_end_and_more(self):
        t = tracker(10)
        for token in [1, 15]:
            t.observe(token)
        assert t.state == DONE and t.tokens == 1  # the token that wrote the end is not reasoning

    def test_a_call_opened_inside_reasoning_ends_it(self):
        t = tracker(10)
        for token in [1, 9]:
            t.observe(token)
        assert t.state == DONE and t.tokens == 1 and t.next_forced() is None

    def test_no_budget_is_ever_forced_twice(self):
        t = tracker(1)
        run(t, [1, 1, 7, 1, 1, 1])
        assert t.next_forced() is None and t.tokens == 1


class TestOpening:
    def test_the_model_opens_reasoning_itself(self):
        t = tracker(2, opened=False, start="<think>")
        assert t.state == IDLE
        assert run(t, [8, 7, 1, 1, 1, 1]) == [8, 7, 1, 1, 3, 1, 1] and t.tokens == 2

    def test_output_that_starts_with_an_answer_has_no_reasoning(self):
        t = tracker(2, opened=False, start="<think>")
        assert run(t, [1, 7, 1, 1, 1]) == [1, 7, 1, 1, 1] and t.tokens == 0 and t.state == DONE

    def test_a_start_spelled_in_pieces(self):
        vocab = {**VOCAB, 20: "<th", 21: "ink>"}
        budget = ReasoningBudget(tokens=1, start="<think>", **THINK)
        t = ReasoningTracker(budget, vocab.__getitem__)
        for token in [20, 21]:
            t.observe(token)
        assert t.state == COUNTING


class TestMultiTokenEnd:
    def test_the_whole_end_is_forced(self):
        t = tracker(2, markers=K3)
        assert run(t, [1, 1, 1]) == [1, 1, 10, 11, 12, 13, 14, 12, 1] and t.tokens == 2

    def test_an_end_begun_by_the_model_is_finished_not_restarted(self):
        t = tracker(2, markers=K3)
        t.observe(1)
        t.observe(10)  # the model's own <|close|>, the budget's last token
        assert t.next_forced() == 11 and t.state == FORCING
        assert t.tokens == 1


class TestUpstreamWatch:
    """`overruns`: the upstream sampled; within the budget its token is observed, past it the choice resumes."""

    def test_an_upstream_that_forces_the_end_itself_never_overruns(self):
        t = tracker(2)
        assert [t.overruns(token) or t.observe(token) for token in [1, 1, 3, 1]] == [None] * 4
        assert t.state == DONE and t.tokens == 2

    def test_a_reasoning_token_past_the_budget_overruns(self):
        t = tracker(2)
        for token in [1, 1]:
            assert not t.overruns(token)
            t.observe(token)
        assert t.overruns(1) and t.remaining_forced() == (3,)

    def test_an_end_only_partly_forced_is_finished_by_the_resume(self):
        t = tracker(1, markers=K3)
        for token in [1, 10, 11]:
            assert not t.overruns(token)
            t.observe(token)
        assert t.overruns(1) and t.remaining_forced() == (12, 13, 14, 12)

    def test_after_the_end_itself_what_follows_is_the_models(self):
        """An upstream that forced the end but not K3's response opener after it: reasoning is over."""
        t = tracker(1, markers=K3)
        for token in [1, 10, 11, 12]:
            assert not t.overruns(token)
            t.observe(token)
        assert not t.overruns(1) and t.state == DONE


@pytest.mark.parametrize("tokens", [0, 1, 5, 40])
def test_long_reasoning_keeps_its_count_as_its_text_window_slides(tokens):
    t = tracker(tokens)
    written = run(t, [1] * 600 + [2])
    assert written.index(3) == tokens and t.tokens == tokens


def test_an_end_after_a_long_reasoning_uncounts_only_its_own_tokens():
    t = tracker(10_000)
    run(t, [1, 2] * 700 + [4, 5, 6, 1])
    assert t.state == DONE and t.tokens == 1400
