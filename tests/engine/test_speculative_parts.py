"""The parts of speculative decoding one at a time: n-gram lookup, the draft planner, and the batch cache's
placement of several tokens a row (masking out rejected ones, squeezing out the holes)."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from deltafin.engine.kv.batch import BatchKV
from deltafin.engine.local.speculative.cost import TokenCost
from deltafin.engine.local.speculative.ngram import NgramIndex
from deltafin.engine.local.speculative.planner import PRIOR, DraftPlanner


class TestNgramIndex:
    def test_the_tokens_after_the_latest_earlier_occurrence_of_the_longest_match(self):
        index = NgramIndex(1, 3)
        #          0  1  2  3  4  5  6  7  8  9  10 11
        context = [5, 6, 7, 8, 9, 6, 7, 1, 2, 5, 6, 7]
        # [5, 6, 7] occurred at 0-2: what followed it there (8, 9, ...); [6, 7] alone would say 1, 2 (latest)
        assert index.propose(context, 3) == [8, 9, 6]
        assert index.propose([*context, 3], 2) == []  # [7, 3], [3]: never seen before
        assert index.propose([*context, 3, 6], 2) == [7, 3]  # [6] alone: its latest occurrence, at 10

    def test_grows_with_the_context_and_honours_the_limit(self):
        index = NgramIndex(2, 2)
        context = [1, 2, 3]
        assert index.propose(context, 4) == []
        context += [4, 1, 2]
        assert index.propose(context, 4) == [3, 4, 1, 2]
        assert index.propose(context, 1) == [3]
        assert index.propose(context, 0) == []

    def test_a_continuation_may_run_into_the_matched_tail(self):
        index = NgramIndex(1, 2)
        assert index.propose([7, 7, 7], 5) == [7]  # [7, 7] occurred at 0-1, followed by the last 7

    def test_a_short_context(self):
        index = NgramIndex(2, 4)
        assert index.propose([1], 3) == [] and index.propose([], 3) == []


class Row:
    """A row stand-in (the planner keeps rates by row, weakly)."""


class TestDraftPlanner:
    def test_a_new_row_drafts_on_its_prior(self):
        planner = DraftPlanner(8, 0.25)
        (limit,) = planner.limits([Row()], [100])
        assert 1 <= limit <= 8

    def test_acceptance_raises_and_rejection_lowers_a_rows_drafts(self):
        planner = DraftPlanner(16, 0.25)
        good, bad = Row(), Row()
        for _ in range(6):
            planner.record(good, 8, 8)
            planner.record(bad, 0, 1)
        # the bad row's rate is pulled toward all rows' acceptance (its prior), the good row's guesses included
        assert planner.rate(good) > 0.9 and planner.rate(bad) < 0.35
        good_limit, bad_limit = planner.limits([good, bad], [100, 100])
        assert good_limit >= 8 and bad_limit == 0

    def test_a_row_that_stopped_drafting_tries_again_later(self):
        planner = DraftPlanner(8, 0.25)
        row = Row()
        for _ in range(6):
            planner.record(row, 0, 1)
        assert planner.limits([row], [100]) == [0]
        for _ in range(90):  # steps without guesses: the rate drifts back up (its own, and all rows' as its prior)
            planner.record(row, 0, 0)
        assert planner.limits([row], [100])[0] >= 1
        for _ in range(400):
            planner.record(row, 0, 0)
        assert abs(planner.rate(row) - PRIOR) < 0.05

    def test_in_a_full_batch_a_row_it_knows_little_of_tries_one_guess(self):
        """At 8 rows a guess at the prior rate (0.7) does not pay (it must yield 0.25 * 8 / 2.75 = 0.73 of a
        token): each row tries one anyway, to learn whether it copies, and stops once its guesses fail."""
        planner = DraftPlanner(16, 0.25)
        rows = [Row() for _ in range(8)]
        assert planner.limits(rows, [100] * 8) == [1] * 8
        for _ in range(3):
            for row in rows:
                planner.record(row, 0, 1)
        assert planner.limits(rows, [100] * 8) == [0] * 8

    def test_a_new_row_starts_from_what_the_others_guesses_are_worth(self):
        """Eight rows: a guess must yield more than at one row (each row's own token already pays the pass), so a
        row that knows nothing drafts only where the batch's guesses have been accepted."""
        copying, failing = DraftPlanner(16, 0.25), DraftPlanner(16, 0.25)
        for _ in range(20):
            copying.record(Row(), 9, 10)
            failing.record(Row(), 1, 10)
        assert copying.prior > 0.85 and failing.prior < 0.3
        assert min(copying.limits([Row() for _ in range(8)], [100] * 8)) >= 1
        assert failing.limits([Row() for _ in range(8)], [100] * 8) == [0] * 8

    def test_room_caps_the_drafts(self):
        planner = DraftPlanner(8, 0.01)
        row = Row()
        planner.record(row, 8, 8)
        assert planner.limits([row, Row()], [3, 0]) == [3, 0]

    def test_a_full_batch_drafts_less_than_one_row(self):
        """Each row's next token already pays a pass's cost: guesses must yield more there to be worth it."""
        planner = DraftPlanner(16, 0.25)
        rows = [Row() for _ in range(8)]
        for row in rows:
            planner.record(row, 7, 10)
        alone = planner.limits(rows[:1], [100])[0]
        batch = planner.limits(rows, [100] * 8)
        assert max(batch) < alone


def _passes(cost: TokenCost, fixed: float, per_token: float, tokens=range(8, 25), times: int = 1) -> None:
    """Passes of 8 to 24 tokens (8 rows, some drafting) that took fixed + per_token * tokens seconds."""
    for _ in range(times):
        for count in tokens:
            cost.record(count, fixed + per_token * count)


class TestTokenCost:
    def test_the_line_through_the_passes_gives_a_tokens_share_of_a_step(self):
        cost = TokenCost(0.25)
        _passes(cost, 0.004, 0.002, times=20)
        a, b = cost.line
        assert abs(a - 0.004) < 2e-4 and abs(b - 0.002) < 1e-4
        assert abs(cost.relative - 0.002 / 0.006) < 0.01

    def test_passes_all_of_one_size_keep_the_prior(self):
        cost = TokenCost(0.25)
        _passes(cost, 0.004, 0.002, tokens=[8], times=100)
        a, b = cost.line
        assert abs(cost.relative - 0.25) < 1e-6 and abs(a + 8 * b - 0.02) < 1e-6

    def test_a_stalled_pass_barely_moves_it(self):
        cost = TokenCost(0.25)
        _passes(cost, 0.004, 0.002, times=10)
        before = cost.relative
        cost.record(24, 5.0)  # preempted: 5 s instead of 52 ms
        assert abs(cost.relative - before) < 0.02

    def test_a_stall_among_the_first_passes_is_clipped_and_later_passes_bring_the_price_down(self):
        """A first call's allocations can make an early pass many times slower: counted whole, one such pass
        put c at 1, where no guess pays and the steps (all of one size then) never moved it again."""
        cost = TokenCost(0.25)
        cost.record(2, 0.05)
        cost.record(17, 1.0)  # a warm-up stall: ~0.2 s expected
        assert cost.relative < 0.9
        for _ in range(50):  # plain one-token steps at their usual 40 ms
            cost.record(1, 0.04)
        assert cost.relative < 0.6

    def test_nonsense_is_ignored(self):
        cost = TokenCost(0.25)
        cost.record(0, 0.01)
        cost.record(8, 0.0)
        cost.record(8, float("nan"))
        assert cost.passes == 0 and cost.relative == 0.25


class TestMeasuredCostInThePlanner:
    def test_drafting_stops_when_tokens_are_measured_expensive_and_resumes_when_cheap(self):
        planner = DraftPlanner(16, 0.25)
        rows = [Row() for _ in range(8)]
        for row in rows:
            planner.record(row, 9, 10)
        assert min(planner.limits(rows, [100] * 8)) >= 1  # the prior cost: every row guesses
        _passes(planner.cost, 0.0, 0.004, times=40)  # a token costs a whole step: a guess cannot pay
        assert planner.token_cost > 0.9
        assert planner.limits(rows, [100] * 8) == [0] * 8
        _passes(planner.cost, 0.02, 0.0002, times=200)  # the weights' read is all a step costs
        assert planner.token_cost < 0.03
        assert min(planner.limits(rows, [100] * 8)) >= 8

    def test_a_pinned_cost_overrides_the_measurements(self):
        planner = DraftPlanner(16, 0.25)
        _passes(planner.cost, 0.0005, 0.004, times=40)
        planner.token_cost = 0.05
        assert planner.token_cost == 0.05 and planner.cost.passes == 40 * 17


def _cache(length: int, value: float) -> DynamicCache:
    """A one-row, one-layer attention cache whose column j holds value + j."""
    cache = DynamicCache()
    layer = DynamicLayer()
    keys = (value + torch.arange(length, dtype=torch.float32)).view(1, 1, length, 1)
    layer.lazy_initialization(keys, keys)
    layer.keys, layer.values = keys, keys.clone()
    cache.layers, cache.layer_class_to_replicate = [layer], None
    return cache


def _append(kv: BatchKV, placement, values: list[list[float]]) -> None:
    """What a forward pass writes: each row's tokens at its placed columns."""
    layer = kv.cache.layers[0]
    width = placement.mask.shape[1]
    if layer.keys.shape[2] < width:
        pad = layer.keys.new_zeros(kv.rows, 1, width - layer.keys.shape[2], 1)
        layer.keys = torch.cat([layer.keys, pad], dim=2)
        layer.values = torch.cat([layer.values, pad.clone()], dim=2)
    for i, row_values in enumerate(values):
        for j, v in enumerate(row_values):
            layer.keys[i, 0, placement.firsts[i] + j, 0] = v
            layer.values[i, 0, placement.firsts[i] + j, 0] = v


def _row(kv: BatchKV, i: int) -> list[float]:
    return kv.row_cache(i).layers[0].keys.flatten().tolist()


class TestBatchPlacement:
    def test_own_columns_keep_each_row_contiguous(self):
        kv = BatchKV(torch.device("cpu"))
        kv.add(_cache(3, 0.0), 3)
        kv.add(_cache(2, 10.0), 2)
        placement = kv.place([3, 1], own_columns=True)
        assert placement.firsts == [3, 3] and placement.mask.tolist() == [[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]]
        _append(kv, placement, [[3.0, 4.0, 5.0], [12.0]])
        kv.accept(placement, [2, 1])  # row 0 keeps two of its three tokens
        assert kv.lengths == [5, 3] and kv.ends == [5, 4] and kv.positions.tolist() == [5, 3]
        assert _row(kv, 0) == [0, 1, 2, 3, 4] and _row(kv, 1) == [10, 11, 12]
        # the next pass writes row 0 over its rejected column
        placement = kv.place([1, 2], own_columns=True)
        assert placement.firsts == [5, 4]
        _append(kv, placement, [[5.5], [13.0, 14.0]])
        kv.accept(placement, [1, 2])
        assert _row(kv, 0) == [0, 1, 2, 3, 4, 5.5] and _row(kv, 1) == [10, 11, 12, 13, 14]
        assert kv.holes == 0

    def test_appended_columns_leave_holes_that_compact_squeezes_out(self):
        kv = BatchKV(torch.device("cpu"))
        kv.add(_cache(2, 0.0), 2)
        kv.add(_cache(2, 10.0), 2)
        placement = kv.place([3, 1], own_columns=False)
        assert placement.fed == [3, 3] and placement.firsts == [2, 2]
        _append(kv, placement, [[2.0, 3.0, 99.0], [12.0, 98.0, 97.0]])
        kv.accept(placement, [2, 1])
        assert kv.width == 4 and kv.ends == [4, 3]  # columns past the longest kept run are cut off
        placement = kv.place([1, 1], own_columns=False)
        _append(kv, placement, [[4.0], [13.0]])
        kv.accept(placement, [1, 1])
        assert kv.holes == 1 and _row(kv, 1) == [10, 11, 12, 13]  # gathered around its hole
        kv.compact()
        assert kv.holes == 0 and kv.width == 5 and kv.mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]
        assert _row(kv, 0) == [0, 1, 2, 3, 4] and _row(kv, 1) == [10, 11, 12, 13]

    def test_rows_leaving_trim_both_sides(self):
        kv = BatchKV(torch.device("cpu"))
        kv.add(_cache(5, 0.0), 5)
        kv.add(_cache(2, 10.0), 2)
        placement = kv.place([1, 3], own_columns=True)
        _append(kv, placement, [[5.0], [12.0, 13.0, 14.0]])
        kv.accept(placement, [1, 3])
        kv.keep([1])
        assert kv.width == 5 and kv.starts == [0] and kv.ends == [5] and _row(kv, 0) == [10, 11, 12, 13, 14]
