"""Constrained decoding cost: grammar compile time and decode rate with vs without a JSON-schema constraint.

    .venv/bin/python bench/grammar.py [--tokens 128] [--reps 3] [model overrides, e.g. placement=cuda]

Prints, measured in one run on the same loaded model and engine (memo and prefix cache off):
- the one-off cost of reading the tokenizer's vocabulary into xgrammar (at start-up), then the time a request
  waits for its grammar: a JSON schema and a K3 tool-call structural tag, cold (checked and compiled in a
  worker process, sent back serialized, deserialized on a lane thread) and from the cache;
- decode tokens/s of a greedy stream with no constraint and with a JSON-schema constraint, alternating runs,
  medians, and the slowdown (target: under 5%). The schema holds one long string (minLength) so both runs
  decode the same number of tokens; decode rate = (tokens - 1) / (last token - first token);
- the time spent inside the row constraint (fill_mask + accept) per token, and its share of a free decode
  step: the overhead itself, which a busy machine's noise does not blur.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deltafin.engine import EngineFront, GenerationJob, TextDelta  # noqa: E402
from deltafin.engine.local.engine import LocalEngine  # noqa: E402
from deltafin.engine.weights.loader import load_model  # noqa: E402
from deltafin.grammar import constraints  # noqa: E402
from deltafin.grammar.compiled import logits_width, tokenizer_info  # noqa: E402
from deltafin.grammar.service import Grammars  # noqa: E402
from deltafin.markup.selection import forced_calls  # noqa: E402
from deltafin.markup.xtml import XTML  # noqa: E402
from deltafin.prompt import build_chat_format  # noqa: E402
from deltafin.protocol.chat import ChatMessage  # noqa: E402
from deltafin.protocol.sampling import SamplingParams  # noqa: E402
from deltafin.testing import compose_config  # noqa: E402

QUESTION = "Write a detailed story about a lighthouse keeper and the sea, as JSON with one key, story."
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


class TimedGrammar:
    """Wraps a ready grammar: seconds its rows spend inside fill_mask + accept, and how many tokens that covered,
    so the grammar's own share of a decode step is measured directly (not only as a rate difference)."""

    def __init__(self, ready) -> None:
        self.ready = ready
        self.seconds = 0.0
        self.tokens = 0

    def matcher(self):
        row, timer = self.ready.matcher(), self

        class Timed:
            def fill_mask(self, logits):
                started = time.perf_counter()
                row.fill_mask(logits)
                timer.seconds += time.perf_counter() - started

            def accept(self, token_id):
                started = time.perf_counter()
                row.accept(token_id)
                timer.seconds += time.perf_counter() - started
                timer.tokens += 1

            def is_terminated(self):
                return row.is_terminated()

        return Timed()


def story_schema(tokens: int) -> dict:
    # Far more characters than `tokens` tokens can hold: the string never closes before the budget ends.
    return {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": tokens * 16}},
        "required": ["story"],
    }


async def compile_times(grammars: Grammars) -> dict[str, float]:
    out: dict[str, float] = {}
    cases = {
        "json_schema": constraints.json_schema(story_schema(10_000)),
        "k3_tool_call": constraints.structural_tag(XTML.calls(forced_calls([TOOL], "required"), "disabled")),
    }
    for name, constraint in cases.items():
        for phase in ("cold", "cached"):
            started = time.perf_counter()
            await grammars.prepare(constraint)
            out[f"{name}_{phase}_ms"] = round((time.perf_counter() - started) * 1000, 2)
    return out


async def decode_rate(
    front: EngineFront, prompt_ids: list[int], params: SamplingParams, grammar=None
) -> tuple[int, float]:
    stream = await front.start([GenerationJob(tuple(prompt_ids), params, grammar)])
    arrivals: list[float] = []
    async for event in stream:
        if isinstance(event, TextDelta) and event.token_ids:
            arrivals.append(time.perf_counter())
    return len(arrivals), (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


async def main(args: argparse.Namespace) -> dict:
    config = compose_config(args.overrides)
    loaded = load_model(config.model, config.placement)
    width = logits_width(loaded.model)
    started = time.perf_counter()
    info = tokenizer_info(loaded.tokenizer, width, loaded.stop_token_ids)  # once per tokenizer, at start-up
    compiled = {"tokenizer_info_ms": round((time.perf_counter() - started) * 1000, 2)}
    grammars = Grammars(info, width, workers=1, timeout_s=60)
    compiled.update(await compile_times(grammars))
    engine = LocalEngine(loaded, prefix_cache_min_tokens=None)
    front = EngineFront(engine, max_waiting=1, timeout_s=600, memo_entries=0)
    fmt = build_chat_format(
        config.model.chat_format,
        loaded.tokenizer,
        content_format=config.model.content_format,
        default_kwargs=dict(config.model.chat_template_kwargs),
    )
    prompt_ids = fmt.render([ChatMessage(role="user", content=QUESTION)], None, {}).token_ids
    free = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    story = constraints.json_schema(story_schema(args.tokens))
    constrained = SamplingParams(max_tokens=args.tokens, temperature=0.0, constraint=story)
    timed = TimedGrammar((await grammars.prepare(story))[0])
    rates: dict[str, list[float]] = {"free": [], "json_schema": []}
    await decode_rate(front, prompt_ids, free)  # warm-up (allocator, kernels)
    for _ in range(args.reps):
        for name, params, grammar in (("free", free, None), ("json_schema", constrained, timed)):
            tokens, rate = await decode_rate(front, prompt_ids, params, grammar)
            assert tokens == args.tokens, f"{name}: {tokens} tokens, expected {args.tokens}"
            rates[name].append(rate)
    free_rate, json_rate = statistics.median(rates["free"]), statistics.median(rates["json_schema"])
    await front.aclose()
    grammars.close()
    return {
        "device": str(next(loaded.model.parameters()).device),
        "model": config.model.name,
        "vocab": width,
        "tokens": args.tokens,
        "reps": args.reps,
        **compiled,
        "decode_tok_s_free": round(free_rate, 2),
        "decode_tok_s_json_schema": round(json_rate, 2),
        "slowdown_pct": round((free_rate / json_rate - 1) * 100, 2),
        "mask_us_per_token": round(timed.seconds / timed.tokens * 1e6, 1),
        "mask_share_of_free_step_pct": round(timed.seconds / timed.tokens * free_rate * 100, 2),
        "runs": {k: [round(v, 2) for v in vs] for k, vs in rates.items()},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (model=..., placement=cuda)")
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=2))
