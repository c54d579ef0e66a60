"""The batched local engine with compiled xgrammar grammars: every row of a batch has its own matcher."""

from __future__ import annotations

import asyncio
import json

from deltafin.engine import EngineFront, Finished, GenerationJob, TextDelta
from deltafin.engine.local.engine import LocalEngine
from deltafin.grammar.compiled import logits_width
from deltafin.grammar.constraints import json_schema
from deltafin.protocol.sampling import SamplingParams
from tests.grammar.decoding import grammar_compiler
from tests.grammar.test_row import render

CITY = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["answer"],
}


def test_rows_sampled_side_by_side_each_follow_the_schema(config, loaded_model):
    compile_for = grammar_compiler(
        loaded_model.tokenizer, logits_width(loaded_model.model), loaded_model.stop_token_ids
    )
    front = EngineFront(LocalEngine(loaded_model), max_waiting=1, timeout_s=60, memo_entries=0)
    prompt = tuple(render(config, loaded_model, "What is the capital of France? Answer in JSON."))
    city = json_schema(CITY)
    grammar = compile_for(city)  # one compiled grammar, three rows: each gets a matcher of its own
    constrained = [
        GenerationJob(prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=seed, constraint=city), grammar)
        for seed in (1, 2, 3)
    ]
    free = GenerationJob(prompt, SamplingParams(max_tokens=8, temperature=0.0))

    async def run() -> tuple[dict[int, str], dict[int, str]]:
        stream = await front.start([*constrained, free])  # four rows in one batch, the last unconstrained
        texts: dict[int, str] = {}
        reasons: dict[int, str] = {}
        async for event in stream:
            if isinstance(event, TextDelta):
                texts[event.choice] = texts.get(event.choice, "") + event.text
            elif isinstance(event, Finished):
                reasons[event.choice] = event.reason
        await front.aclose()
        return texts, reasons

    texts, reasons = asyncio.run(run())
    for choice in range(3):
        assert json.loads(texts[choice])["answer"] in ("Paris", "Rome", "Oslo") and reasons[choice] == "stop"
    assert reasons[3] in ("stop", "length")  # the free row beside them is not held to the grammar
