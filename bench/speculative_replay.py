"""What a cheaper guess would buy: the copy-heavy task of bench/speculative.py replayed through the n-gram drafter
and the draft planner at several prices of a guess, without timing anything.

    .venv/bin/python bench/speculative_replay.py [--costs 0.25 0.2 0.15] [--tasks 2]

The greedy tokens of each task are generated once (the real engine, `engine.speculative.method=none`: greedy
speculation gives the same tokens). Then, step by step, the engine's own NgramIndex guesses from the prompt and
the tokens so far and the engine's own DraftPlanner (its price of a guess pinned to c) says how many guesses to
take; a step costs 1 + c x (guesses) one-token passes and yields the guesses that match plus one. The figure is
tokens / cost: the speedup over `none` that a machine where a guess costs c of a one-token step would see, on
this model's text. Beside it: fixed draft lengths, the draft length tied to the n-gram match's length, and an
oracle that knows how many guesses will match (what no drafter can beat with these guesses).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deltafin.config import SpeculativeConfig  # noqa: E402
from deltafin.engine import EngineFront, GenerationJob, TextDelta  # noqa: E402
from deltafin.engine.local.engine import LocalEngine  # noqa: E402
from deltafin.engine.local.speculative.ngram import NgramIndex  # noqa: E402
from deltafin.engine.local.speculative.planner import DraftPlanner  # noqa: E402
from deltafin.engine.weights.loader import load_model  # noqa: E402
from deltafin.protocol.sampling import SamplingParams  # noqa: E402
from deltafin.testing import compose_config  # noqa: E402

#: a draft policy: (planner, row, n-gram match length, guesses available) -> guesses taken
Policy = Callable[[DraftPlanner, object, int, int], int]


def speculative_bench():
    """bench/speculative.py as a module (its task prompts)."""
    spec = importlib.util.spec_from_file_location("speculative_bench", REPO / "bench" / "speculative.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def greedy_tokens(front: EngineFront, prompt: Sequence[int], tokens: int) -> list[int]:
    async def run() -> list[int]:
        stream = await front.start([GenerationJob(tuple(prompt), SamplingParams(temperature=0.0, max_tokens=tokens))])
        out: list[int] = []
        async for event in stream:
            if isinstance(event, TextDelta):
                out.extend(event.token_ids)
        return out

    return asyncio.run(run())


def match(index: NgramIndex, context: list[int]) -> tuple[int, list[int]]:
    """(length of the longest n-gram matched, the tokens after its latest earlier occurrence, up to 64)."""
    guesses = index.propose(context, 64)
    end = len(context)
    for n in range(min(index.high, end), index.low - 1, -1):
        if index.tables[n].get(tuple(context[end - n :])) is not None:
            return n, guesses
    return 0, guesses


def replay(prompt: list[int], out: list[int], cost: float, policy: Policy | None) -> float:
    """tokens / cost in one-token passes (policy None: the oracle)."""
    config = SpeculativeConfig()
    index = NgramIndex(config.ngram_min, config.ngram_max)
    planner = DraftPlanner(config.tokens, cost)
    planner.token_cost = cost
    row = object.__new__(type("Row", (), {}))
    spent, at = 0.0, 0
    while at < len(out) - 1:
        n, guesses = match(index, prompt + out[: at + 1])
        matched = 0
        while matched < len(guesses) and at + 1 + matched < len(out) and guesses[matched] == out[at + 1 + matched]:
            matched += 1
        taken = matched if policy is None else min(len(guesses), policy(planner, row, n, len(guesses)))
        accepted = min(matched, taken)
        planner.record(row, accepted, min(taken, accepted + 1))
        spent += 1 + cost * taken
        at += accepted + 1
    return (len(out) - 1) / spent


def planned(planner: DraftPlanner, row: object, n: int, available: int) -> int:
    return planner.limits([row], [64])[0]


def fixed(count: int) -> Policy:
    return lambda planner, row, n, available: count


def by_match(least: int, longer: int) -> Policy:
    """the planner's count, raised to `longer` when the n-gram matched is at least `least` tokens long"""
    return lambda planner, row, n, available: max(planned(planner, row, n, available), longer if n >= least else 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--costs", type=float, nargs="+", default=[0.25, 0.2, 0.15])
    parser.add_argument("--tasks", type=int, default=2, help="copy-heavy renames (bench/speculative.py's)")
    parser.add_argument("--tokens", type=int, default=400)
    args = parser.parse_args()
    bench = speculative_bench()
    config = compose_config()
    loaded = load_model(config.model, config.placement)
    front = EngineFront(
        LocalEngine(loaded, speculative=SpeculativeConfig(method="none")), max_waiting=4, timeout_s=600, memo_entries=0
    )
    policies: dict[str, Policy | None] = {
        "planner": planned,
        "fixed 2": fixed(2),
        "fixed 4": fixed(4),
        "fixed 8": fixed(8),
        "match >= 6: 8": by_match(6, 8),
        "oracle": None,
    }
    for task in range(args.tasks):
        messages = bench.copy_messages(bench.NEW_NAMES[task])
        prompt = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        out = greedy_tokens(front, prompt, args.tokens)
        print(f"copy-heavy task {task + 1} ({bench.NEW_NAMES[task]}): {len(prompt)} prompt tokens, {len(out)} written")
        for cost in args.costs:
            row = "  ".join(f"{name} {replay(prompt, out, cost, policy):.2f}x" for name, policy in policies.items())
            print(f"  c = {cost}: {row}")


if __name__ == "__main__":
    main()
