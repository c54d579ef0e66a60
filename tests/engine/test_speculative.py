"""Speculative decoding through the real engine on the real default model (native GGUF step): every request gives
exactly what it gives without speculation (`engine.speculative.method=none`), token for token, whatever lands
inside a draft (stop strings and ids, max_tokens, the grammar), alone or beside other rows; and drafts are
really taken (checked on a prompt the model copies from)."""

from __future__ import annotations

import asyncio

import pytest

from deltafin.config import SpeculativeConfig
from deltafin.engine import EngineFront, Finished, GenerationJob, TextDelta
from deltafin.engine.local.engine import LocalEngine
from deltafin.protocol.sampling import Constraint, ReasoningBudget, SamplingParams
from tests.grammar.decoding import grammar_compiler

FUNCTION = '''def summarize_orders(orders, tax_rate, discount_codes):
    """Return the subtotal, discount, tax and total of a list of orders."""
    subtotal = 0.0
    discount = 0.0
    for order in orders:
        for line in order["lines"]:
            price = float(line["unit_price"])
            quantity = int(line["quantity"])
            subtotal += price * quantity
        code = order.get("discount_code")
        if code is not None and code in discount_codes:
            discount += subtotal * discount_codes[code]
    taxable = max(subtotal - discount, 0.0)
    tax = round(taxable * tax_rate, 2)
    return {"subtotal": subtotal, "discount": discount, "tax": tax, "total": taxable + tax}
'''
#: a copy-heavy request: the model rewrites code it was shown (and repeats itself), so n-gram drafts are accepted
COPY = (
    "Rename the function summarize_orders to order_summary and change nothing else:\n\n```python\n" + FUNCTION + "```"
)
OPEN = "Tell me a story about a dragon who learns to cook."


def chat_ids(tokenizer, text: str) -> tuple[int, ...]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return tuple(ids["input_ids"] if hasattr(ids, "keys") else ids)


async def collect(front: EngineFront, jobs) -> tuple[dict[int, list[int]], dict[int, Finished], dict[int, list]]:
    stream = await front.start(jobs)
    tokens: dict[int, list[int]] = {}
    finished: dict[int, Finished] = {}
    logprobs: dict[int, list] = {}
    async for event in stream:
        if isinstance(event, TextDelta):
            tokens.setdefault(event.choice, []).extend(event.token_ids)
            logprobs.setdefault(event.choice, []).extend(event.logprobs)
        elif isinstance(event, Finished):
            finished[event.choice] = event
    return tokens, finished, logprobs


def front_for(loaded, method: str = "none", **settings) -> EngineFront:
    engine = LocalEngine(loaded, speculative=SpeculativeConfig(method=method, **settings))
    return EngineFront(engine, max_waiting=16, timeout_s=120, memo_entries=0)


@pytest.fixture(scope="module")
def plain(loaded_model, loop):
    front = front_for(loaded_model)
    yield front
    loop.run_until_complete(front.client.aclose())


@pytest.fixture(scope="module")
def ngram(loaded_model, loop):
    front = front_for(loaded_model, "ngram")
    yield front
    loop.run_until_complete(front.client.aclose())


@pytest.fixture
def run(loop):
    return loop.run_until_complete


@pytest.fixture
def both(plain, ngram, run):
    """jobs -> (without speculation, with n-gram speculation) results, one request each."""

    def go(jobs):
        return run(collect(plain, jobs)), run(collect(ngram, jobs))

    return go


def ending(finished: dict[int, Finished]) -> dict[int, tuple]:
    """What a choice's end says of its tokens (not its timings, nor what the prefix cache held)."""
    return {c: (f.reason, f.stop_reason, f.completion_tokens) for c, f in finished.items()}


def greedy(tokenizer, text: str, **params) -> GenerationJob:
    return GenerationJob(chat_ids(tokenizer, text), SamplingParams(temperature=0.0, **params))


@pytest.fixture(scope="module")
def tokenizer(loaded_model):
    return loaded_model.tokenizer


class TestSameOutputAsWithout:
    def test_greedy_copying_takes_drafts_and_changes_nothing(self, both, ngram, tokenizer):
        spec = ngram.client.speculation
        before, steps_before = spec.accepted, len(spec.drafts)
        (tokens, end, _), (spec_tokens, spec_end, _) = both([greedy(tokenizer, COPY, max_tokens=120)])
        assert spec_tokens == tokens and ending(spec_end) == ending(end)
        accepted = spec.accepted - before
        steps = len(spec.drafts) - steps_before
        # each step gives one token and its accepted guesses (the first token comes from the prefill)
        assert accepted > 20 and steps == len(tokens[0]) - 1 - accepted
        timings = spec_end[0].timings
        assert timings["spec_accepted_tokens"] == accepted and timings["spec_draft_tokens"] >= accepted

    def test_the_price_of_a_guess_comes_from_the_passes_the_engine_ran(self, both, ngram, tokenizer):
        """Every pass is timed; a line through them (fixed cost, cost per token) prices the planner's guesses."""
        cost = ngram.client.speculation.planner.cost
        passes = cost.passes
        (tokens, _, _), (spec_tokens, _, _) = both([greedy(tokenizer, COPY, max_tokens=60)])
        assert spec_tokens == tokens
        assert cost.passes > passes and cost.line is not None
        fixed, per_token = cost.line
        # both parts of a pass are there (the weights read once, the compute per token), whatever the machine
        assert fixed > 0 and per_token > 0 and 0 < cost.relative < 1
        assert cost.pinned is None and ngram.client.speculation.planner.token_cost == cost.relative

    def test_open_ended_text(self, both, tokenizer):
        (tokens, _, _), (spec_tokens, _, _) = both([greedy(tokenizer, OPEN, max_tokens=120)])
        assert spec_tokens == tokens and len(tokens[0]) > 50

    def test_logprobs(self, both, tokenizer):
        job = greedy(tokenizer, COPY, max_tokens=60, logprobs=True, top_logprobs=3)
        (tokens, _, logprobs), (spec_tokens, _, spec_logprobs) = both([job])
        assert spec_tokens == tokens and spec_logprobs == logprobs and len(logprobs[0]) == 60

    def test_a_stop_string_inside_a_draft(self, both, ngram, tokenizer):
        (tokens, _, _), _ = both([greedy(tokenizer, COPY, max_tokens=120)])
        stop = tokenizer.decode(tokens[0][70:73])  # deep in a stretch the drafts cover
        job = greedy(tokenizer, COPY, max_tokens=120, stop=(stop,))
        (tokens, end, _), (spec_tokens, spec_end, _) = both([job])
        assert spec_tokens == tokens and ending(spec_end) == ending(end) and end[0].stop_reason == stop

    def test_a_stop_token_inside_a_draft(self, both, tokenizer):
        (tokens, _, _), _ = both([greedy(tokenizer, COPY, max_tokens=120)])
        stop_id = tokens[0][80]
        job = greedy(tokenizer, COPY, max_tokens=120, stop_token_ids=(stop_id,))
        (tokens, end, _), (spec_tokens, spec_end, _) = both([job])
        assert spec_tokens == tokens and ending(spec_end) == ending(end) and end[0].stop_reason == stop_id

    @pytest.mark.parametrize("max_tokens", [1, 2, 37, 61])
    def test_max_tokens_inside_a_draft(self, both, tokenizer, max_tokens):
        job = greedy(tokenizer, COPY, max_tokens=max_tokens, ignore_eos=True)
        (tokens, end, _), (spec_tokens, spec_end, _) = both([job])
        assert spec_tokens == tokens and len(tokens[0]) == max_tokens and spec_end[0].reason == "length"

    def test_seeded_sampling_with_every_knob(self, both, tokenizer):
        knobs = [
            dict(temperature=0.7, seed=1, top_p=0.9),
            dict(temperature=0.9, seed=2, top_k=20, repetition_penalty=1.1),
            dict(temperature=0.6, seed=3, min_p=0.05, frequency_penalty=0.3, presence_penalty=0.2),
        ]
        for knob in knobs:
            job = GenerationJob(chat_ids(tokenizer, COPY), SamplingParams(max_tokens=60, ignore_eos=True, **knob))
            (tokens, _, _), (spec_tokens, _, _) = both([job])
            assert spec_tokens == tokens, knob

    def test_n_choices(self, both, tokenizer):
        ids = chat_ids(tokenizer, COPY)
        jobs = [GenerationJob(ids, SamplingParams(max_tokens=50, temperature=0.8, seed=s)) for s in (5, 6, 7)]
        (tokens, _, _), (spec_tokens, _, _) = both(jobs)
        assert spec_tokens == tokens and len({tuple(t) for t in tokens.values()}) == 3

    @pytest.mark.parametrize("budget", [0, 9, 30])
    def test_a_thinking_budget_forcing_its_end_inside_a_draft(self, both, ngram, tokenizer, budget):
        # The prompt's output counts as reasoning from its first token; at the budget the end is forced, where a
        # copying row's draft (and greedy's argmax) says otherwise.
        end = "</reasoning>"
        forced = tuple(tokenizer(end, add_special_tokens=False).input_ids)
        reasoning = ReasoningBudget(tokens=budget, ends=(end,), forced=forced, forced_text=end, opened="<think>")
        job = greedy(tokenizer, COPY, max_tokens=60, ignore_eos=True, reasoning_budget=reasoning)
        drafted = ngram.client.speculation.drafted
        (tokens, _, _), (spec_tokens, _, _) = both([job])
        assert spec_tokens == tokens and tuple(tokens[0][budget : budget + len(forced)]) == forced
        assert ngram.client.speculation.drafted > drafted

    def test_a_grammar_row(self, both, tokenizer, loaded_model):
        ready = grammar_compiler(tokenizer, ngram_vocab(loaded_model), loaded_model.stop_token_ids)
        constraint = Constraint("json_object")
        params = SamplingParams(max_tokens=80, temperature=0.0, constraint=constraint)
        text = "Give me a JSON object describing this function:\n" + FUNCTION
        job = GenerationJob(chat_ids(tokenizer, text), params, ready(constraint))
        (tokens, end, _), (spec_tokens, spec_end, _) = both([job])
        assert spec_tokens == tokens and ending(spec_end) == ending(end)


def ngram_vocab(loaded) -> int:
    from deltafin.grammar.compiled import logits_width

    return logits_width(loaded.model)


class TestBatched:
    def test_rows_beside_each_other_give_their_solo_tokens(self, plain, ngram, run, tokenizer):
        """Four requests of different kinds at once: each row verifies its own draft (different lengths in one
        pass, rows without any), and each gives what it gives alone without speculation."""
        jobs = [
            greedy(tokenizer, COPY, max_tokens=90),
            greedy(tokenizer, OPEN, max_tokens=60, ignore_eos=True),
            GenerationJob(chat_ids(tokenizer, COPY), SamplingParams(max_tokens=70, temperature=0.8, seed=11)),
            greedy(tokenizer, "Count from one to twenty in words.", max_tokens=40),
        ]
        solo = [run(collect(plain, [job]))[0] for job in jobs]

        async def together():
            tasks = []
            for job in jobs:
                tasks.append(asyncio.ensure_future(collect(ngram, [job])))
                await asyncio.sleep(0.05)
            return [tokens for tokens, _, _ in await asyncio.gather(*tasks)]

        spec = ngram.client.speculation
        spec.drafts.clear()
        assert run(together()) == solo
        mixed = [lengths for lengths in spec.drafts if len(lengths) >= 2 and len(set(lengths)) > 1]
        assert mixed, "no step verified drafts of different lengths together"

    def test_a_prefix_cache_hit_after_speculation(self, ngram, plain, run, tokenizer):
        """A row's cache given back after speculative steps holds exactly its tokens: the next turn reuses it."""
        first = chat_ids(tokenizer, COPY)
        ngram.client.prefix_cache.clear()
        tokens, _, _ = run(collect(ngram, [GenerationJob(first, SamplingParams(max_tokens=80, temperature=0.0))]))
        follow = first + tuple(tokens[0]) + tuple(tokenizer("\nAnd again?", add_special_tokens=False).input_ids)
        job = GenerationJob(follow, SamplingParams(max_tokens=40, temperature=0.0))
        again, end, _ = run(collect(ngram, [job]))
        assert end[0].cached_tokens >= len(first) + len(tokens[0]) - 1
        plain.client.prefix_cache.clear()
        assert again == run(collect(plain, [job]))[0]


class TestFloatWeights:
    def test_the_fused_torch_step_gives_what_it_gives_without(self, float_model, run, tokenizer):
        """The dequantized weights run the fused torch step: drafts are appended to every row (padded), and the
        tokens are none's (float reassociation between a [B, C] pass and C steps moves no argmax here)."""
        plain, spec = front_for(float_model), front_for(float_model, "ngram")
        jobs = [greedy(tokenizer, COPY, max_tokens=80), greedy(tokenizer, OPEN, max_tokens=40, ignore_eos=True)]
        solo = [run(collect(plain, [job]))[0] for job in jobs]

        async def together():
            tasks = [asyncio.ensure_future(collect(spec, [job])) for job in jobs]
            return [tokens for tokens, _, _ in await asyncio.gather(*tasks)]

        assert run(together()) == solo
        speculation = spec.client.speculation
        assert speculation.accepted > 10
        # where no guess pays, every step is the plain decode step, and each is still timed: the price of a
        # guess keeps being measured, so one measured too high can come down
        speculation.planner.token_cost = 1.0
        steps, passes = len(speculation.drafts), speculation.planner.cost.passes
        assert run(collect(spec, [jobs[0]]))[0] == solo[0]
        steps = len(speculation.drafts) - steps
        assert steps > 70 and set(speculation.drafts[-1]) == {0}
        assert speculation.planner.cost.passes - passes == steps
        run(plain.client.aclose())
        run(spec.client.aclose())


class RaisingGrammar:
    """A ready grammar whose row matcher allows everything, then raises at its `after`-th mask."""

    def __init__(self, after: int):
        self.after = after

    def matcher(self):
        grammar = self

        class Row:
            calls = 0

            def fill_mask(self, logits):
                self.calls += 1
                if self.calls >= grammar.after:
                    raise RuntimeError("the matcher broke")

            def accept(self, token_id):
                pass

            def is_terminated(self):
                return False

        return Row()


class TestFailures:
    def test_a_row_that_fails_inside_a_draft_costs_the_others_nothing(self, ngram, plain, run, tokenizer):
        other = greedy(tokenizer, COPY, max_tokens=80)
        expected = run(collect(plain, [other]))[0]
        params = SamplingParams(max_tokens=80, temperature=0.0, constraint=Constraint("test", "raise"))
        broken = GenerationJob(chat_ids(tokenizer, COPY), params, RaisingGrammar(after=30))

        async def together():
            failing = asyncio.ensure_future(collect(ngram, [broken]))
            fine = asyncio.ensure_future(collect(ngram, [other]))
            results = await asyncio.gather(failing, fine, return_exceptions=True)
            return results

        failed, fine = run(together())
        assert isinstance(failed, Exception)  # its request fails (the reason goes to the server log)
        assert fine[0] == expected
        # the engine goes on
        assert run(collect(ngram, [other]))[0] == expected
