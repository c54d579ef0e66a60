"""The order in which prompts in prefill share a step's budget."""

from collections import deque
from types import SimpleNamespace

from deltafin.engine.local.prefill_order import finishing_first


def prompt(name: str, remaining: int | None) -> SimpleNamespace:
    work = None if remaining is None else SimpleNamespace(remaining=remaining)
    return SimpleNamespace(name=name, work=work)


def names(prompts: deque) -> list[str]:
    return [p.name for p in prompts]


def test_prompts_that_finish_within_the_budget_go_first_in_arrival_order() -> None:
    prompts = deque([prompt("long1", 5000), prompt("short1", 10), prompt("long2", 900), prompt("short2", 64)])
    finishing_first(prompts, 64)
    assert names(prompts) == ["short1", "short2", "long1", "long2"]


def test_a_prompt_whose_prefix_is_still_read_from_disk_keeps_its_round_robin_place() -> None:
    prompts = deque([prompt("reading", None), prompt("long", 5000), prompt("short", 8)])
    finishing_first(prompts, 64)
    assert names(prompts) == ["short", "reading", "long"]


def test_nothing_moves_when_no_prompt_finishes_or_the_finishing_ones_lead() -> None:
    prompts = deque([prompt("a", 500), prompt("b", None)])
    finishing_first(prompts, 64)
    assert names(prompts) == ["a", "b"]
    prompts = deque([prompt("s", 1), prompt("a", 500)])
    finishing_first(prompts, 64)
    assert names(prompts) == ["s", "a"]
