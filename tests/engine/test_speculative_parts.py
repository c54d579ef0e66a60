"""The parts of speculative decoding one at a time: n-gram lookup, the draft planner, and the batch cache's
placement of several tokens a row (masking out rejected ones, squeezing out the holes)."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from deltafin.engine.kv.batch import BatchKV
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
        assert planner.rate(good) > 0.9 and planner.rate(bad) < 0.25
        good_limit, bad_limit = planner.limits([good, bad], [100, 100])
        assert good_limit >= 8 and bad_limit == 0

    def test_a_row_that_stopped_drafting_tries_again_later(self):
        planner = DraftPlanner(8, 0.25)
        row = Row()
        for _ in range(6):
            planner.record(row, 0, 1)
        assert planner.limits([row], [100]) == [0]
        for _ in range(90):  # steps without guesses: the rate drifts back to the prior
            planner.record(row, 0, 0)
        assert abs(planner.rate(row) - PRIOR) < 0.05 and planner.limits([row], [100])[0] >= 1

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
