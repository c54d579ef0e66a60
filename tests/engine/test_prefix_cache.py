"""The prefix cache's RAM tier over real transformers cache layers: which entry a prompt takes, what it gets
(the entry itself, or views of its shared positions), the byte budget, scopes, and hybrid checkpoints.

Positions here hold their token id as their value, so a test can read back which positions a cache holds; a
state layer's state holds the number of tokens it saw."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from deltafin.engine.kv import cache_layers
from deltafin.engine.kv.checkpoints import Capture, CheckpointBook, attach, book_of
from deltafin.engine.kv.prefix_cache import SOLE_OWNER, PrefixCache, PrefixCacheSettings

DIM = 4  # head dim of the test caches: a position is DIM float32 values in keys and DIM in values


def kv_layer(ids: list[int], room: int = 0) -> DynamicLayer:
    """An attention layer whose positions hold their token ids ([1, 1, S, DIM] views of a buffer with `room`
    spare positions behind them, as the engine's steps leave them)."""
    buffer = torch.zeros(1, 1, len(ids) + room, DIM)
    buffer[0, 0, : len(ids)] = torch.tensor(ids, dtype=torch.float32).unsqueeze(1)
    layer = DynamicLayer()
    keys = buffer[:, :, : len(ids)]
    layer.lazy_initialization(keys, keys)
    layer.keys, layer.values = keys, keys.clone()
    return layer


def state_layer(length: int) -> LinearAttentionLayer:
    layer = LinearAttentionLayer()
    layer.conv_states[0] = torch.full((1, 2, 3), float(length))
    layer.recurrent_states[0] = torch.full((1, 2, 2, 2), float(length))
    layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
    layer.has_previous_state[0] = True
    layer.conv_kernel_size[0] = 3
    return layer


def attention_cache(ids: list[int], room: int = 0):
    return cache_layers.cache_of([kv_layer(ids, room)])


def hybrid_cache(ids: list[int], checkpoints=(), every: int | None = 4):
    """[state layer, attention layer] after `ids`, with a book holding captures at `checkpoints`."""
    cache = cache_layers.cache_of([state_layer(len(ids)), kv_layer(ids)])
    book = CheckpointBook(every)
    for position in checkpoints:
        at = cache_layers.cache_of([state_layer(position), kv_layer(ids[:position])])
        book.at[position] = Capture.of(at)
    attach(cache, book)
    return cache


def empty_attention():
    return cache_layers.cache_of([DynamicLayer()])


def empty_hybrid():
    return cache_layers.cache_of([LinearAttentionLayer(), DynamicLayer()])


def positions(cache) -> list[int]:
    return [int(v) for v in cache.layers[-1].keys[0, 0, :, 0].tolist()]


def state_of(cache) -> float:
    return float(cache.layers[0].recurrent_states[0].flatten()[0])


def pc(new_cache=empty_attention, **settings) -> PrefixCache:
    return PrefixCache(new_cache, PrefixCacheSettings(**{"min_tokens": 2, **settings}))


class TestChoosingAnEntry:
    def test_fresh_cache_when_nothing_is_shared(self):
        cache = pc()
        reuse = cache.take([1, 2, 3])
        assert reuse.cached == 0 and reuse.tier is None and cache_layers.attention_length(reuse.cache) == 0

    def test_a_prompt_that_uses_a_whole_entry_takes_the_entry_itself(self):
        cache = pc()
        kept = attention_cache([1, 2, 3, 4])
        cache.give_back(kept, [1, 2, 3, 4])
        reuse = cache.take([1, 2, 3, 4, 5, 6])
        assert reuse.cache is kept and reuse.cached == 4 and reuse.tier == "ram"
        assert getattr(kept, SOLE_OWNER) and len(cache) == 0

    def test_a_prompt_that_uses_part_of_an_entry_gets_views_and_the_entry_stays(self):
        """Two chats that share only a system prompt do not cut each other back: B starts from views of
        A's shared positions, and A's next turn still finds all of A."""
        cache = pc()
        system = list(range(100, 124))
        chat_a = system + list(range(1000, 1700))
        entry = attention_cache(chat_a)
        cache.give_back(entry, chat_a)
        b = cache.take(system + [7, 8, 9])
        assert b.cached == 24 and b.cache is not entry and positions(b.cache) == system
        assert not getattr(b.cache, SOLE_OWNER, False)  # views of a kept entry: never written in place
        assert b.cache.layers[0].keys.data_ptr() == entry.layers[0].keys.data_ptr()  # no copy
        a = cache.take(chat_a + [5, 6])
        assert a.cache is entry and a.cached == len(chat_a)

    def test_always_leaves_one_prompt_token_to_run(self):
        cache = pc(min_tokens=1)
        cache.give_back(attention_cache([1, 2, 3, 4]), [1, 2, 3, 4])
        reuse = cache.take([1, 2, 3])
        assert reuse.cached == 2 and positions(reuse.cache) == [1, 2]

    def test_short_prefixes_are_not_worth_reusing(self):
        cache = pc(min_tokens=16)
        cache.give_back(attention_cache(list(range(10))), list(range(10)))
        assert cache.take(list(range(12))).cached == 0

    def test_a_tail_shorter_than_min_tokens_is_cut_off_and_the_entry_handed_out(self):
        cache = pc(min_tokens=3)
        entry = attention_cache(list(range(20)))
        cache.give_back(entry, list(range(20)))
        reuse = cache.take([*range(18), 99, 98])  # leaves 2 of the entry's tokens: not worth keeping
        assert reuse.cache is entry and reuse.cached == 18 and positions(entry) == list(range(18))
        assert getattr(entry, SOLE_OWNER) and len(cache) == 0

    def test_the_longest_reusable_prefix_over_all_entries_wins(self):
        cache = pc()
        long, short, other = attention_cache([1, 2, 3, 4, 5, 6]), attention_cache([1, 2, 3, 9]), attention_cache([7, 7])
        cache.give_back(long, [1, 2, 3, 4, 5, 6])
        cache.give_back(short, [1, 2, 3, 9])
        cache.give_back(other, [7, 7])  # the most recent, and useless for the prompt
        reuse = cache.take([1, 2, 3, 4, 5, 8])
        assert reuse.cached == 5 and positions(reuse.cache) == [1, 2, 3, 4, 5]

    def test_a_prefix_entry_is_folded_into_the_entry_that_extends_it(self):
        cache = pc()
        cache.give_back(attention_cache([1, 2, 3]), [1, 2, 3])
        cache.give_back(attention_cache([1, 2, 3, 4, 5]), [1, 2, 3, 4, 5])
        assert len(cache) == 1

    def test_a_cache_that_does_not_hold_its_ids_is_not_stored(self):
        cache = pc()
        cache.give_back(attention_cache([1, 2, 3]), [1, 2, 3, 4])
        assert len(cache) == 0

    def test_disabled_stores_nothing(self):
        cache = pc(enabled=False)
        cache.give_back(attention_cache([1, 2, 3, 4]), [1, 2, 3, 4])
        assert len(cache) == 0 and cache.bytes_held == 0 and cache.take([1, 2, 3, 4, 5]).cached == 0


class TestScopes:
    def test_an_entry_serves_only_its_own_scope(self):
        cache = pc()
        cache.give_back(attention_cache([1, 2, 3, 4]), [1, 2, 3, 4], scope="key-a")
        assert cache.take([1, 2, 3, 4, 5], scope="key-b").cached == 0
        assert cache.take([1, 2, 3, 4, 5], scope="").cached == 0
        assert cache.take([1, 2, 3, 4, 5], scope="key-a").cached == 4

    def test_scopes_do_not_fold_into_each_other(self):
        cache = pc()
        cache.give_back(attention_cache([1, 2, 3]), [1, 2, 3], scope="a")
        cache.give_back(attention_cache([1, 2, 3, 4]), [1, 2, 3, 4], scope="b")
        assert len(cache) == 2


class TestByteBudget:
    BYTES = 2 * 4 * DIM  # keys + values of one position, float32

    def test_entries_stay_under_max_bytes(self):
        cache = pc(max_bytes=50 * self.BYTES)
        for start in range(0, 400, 20):
            ids = list(range(start, start + 20))
            cache.give_back(attention_cache(ids), ids)
            assert cache.bytes_held <= 50 * self.BYTES
        assert len(cache) == 2 and cache.stats.evictions["ram"] == 18
        assert cache.stats.bytes_held["ram"] == cache.bytes_held == 40 * self.BYTES

    def test_entries_never_reused_leave_before_reused_ones(self):
        cache = pc(max_bytes=40 * self.BYTES)
        a = list(range(0, 10))
        cache.give_back(attention_cache(a), a)
        taken = cache.take([*a, 50, 51])  # a was reused: what its prompt gives back is protected
        cache.give_back(taken.cache, a)
        cache.give_back(attention_cache(list(range(100, 120))), list(range(100, 120)))  # newer, never reused
        cache.give_back(attention_cache(list(range(200, 220))), list(range(200, 220)))  # over budget
        held = sorted(int(entry.ids[0]) for entry in cache.entries)
        assert held == [0, 200]

    def test_a_row_of_a_batch_buffer_is_copied_to_its_own_size(self):
        """A row leaving the batch is a view of the whole batch's buffers; kept as it is, one 20-position row of
        eight would hold eight rows' bytes (copies of less than a MiB are not worth making: these rows are
        64 KiB wide)."""
        cache = pc()
        width = 16384
        batch = torch.zeros(8, 1, 20, width)
        layer = DynamicLayer()
        layer.lazy_initialization(batch[3:4], batch[3:4])
        layer.keys, layer.values = batch[3:4], batch[3:4].clone()
        row = cache_layers.cache_of([layer])
        cache.give_back(row, list(range(20)))
        assert cache.bytes_held == 2 * 20 * 4 * width
        assert row.layers[0].keys.untyped_storage().nbytes() == 20 * 4 * width

    def test_spare_room_of_a_long_prompt_is_kept(self):
        """The steps leave room behind a prompt's positions (its next tokens append there in place); for a long
        prompt that is a small share, counted and kept."""
        cache = pc()
        entry = attention_cache(list(range(2000)), room=256)
        cache.give_back(entry, list(range(2000)))
        assert entry.layers[0].keys.untyped_storage().nbytes() == 2256 * 4 * DIM
        assert cache.bytes_held == (2256 + 2000) * 4 * DIM  # keys with their room, values without


class TestHybridCheckpoints:
    def test_a_diverging_prompt_starts_from_the_last_checkpoint_before_it_leaves(self):
        cache = pc(new_cache=empty_hybrid, min_tokens=2)
        ids = list(range(1, 15))
        cache.give_back(hybrid_cache(ids, checkpoints=(4, 8, 12)), ids)
        reuse = cache.take([*ids[:10], 99, 98])  # shares 10 tokens: the checkpoint at 8 is the last within them
        assert reuse.cached == 8 and positions(reuse.cache) == ids[:8] and state_of(reuse.cache) == 8.0
        carried = book_of(reuse.cache)
        assert sorted(carried.at) == [4, 8]  # the prompt's own checkpoints go on from there
        assert len(cache) == 1  # the entry stays for prompts that follow it further

    def test_the_checkpoint_state_is_a_copy(self):
        cache = pc(new_cache=empty_hybrid)
        ids = list(range(1, 15))
        entry = hybrid_cache(ids, checkpoints=(8,))
        cache.give_back(entry, ids)
        reuse = cache.take([*ids[:10], 99])
        reuse.cache.layers[0].recurrent_states[0].fill_(-1.0)  # the next prefill writes the state in place
        assert float(book_of(entry).at[8].states[0][0][("recurrent_states", 0)].flatten()[0]) == 8.0

    def test_without_a_checkpoint_in_the_shared_part_nothing_is_reused(self):
        cache = pc(new_cache=empty_hybrid)
        ids = list(range(1, 15))
        cache.give_back(hybrid_cache(ids, checkpoints=(12,)), ids)
        assert cache.take([*ids[:10], 99]).cached == 0

    def test_a_prompt_that_extends_the_whole_entry_takes_its_final_state(self):
        cache = pc(new_cache=empty_hybrid)
        ids = list(range(1, 15))
        entry = hybrid_cache(ids, checkpoints=(4, 8, 12))
        cache.give_back(entry, ids)
        reuse = cache.take([*ids, 50, 51])
        assert reuse.cache is entry and reuse.cached == 14 and state_of(entry) == 14.0

    def test_a_shorter_entry_folds_in_as_a_checkpoint_of_the_longer(self):
        """The prompt's cache comes back after prefill, its row's longer cache when the row leaves: the row's
        entry keeps the prompt's end as a checkpoint, so a prompt leaving right after it loses nothing."""
        cache = pc(new_cache=empty_hybrid)
        prompt = list(range(1, 11))
        answer = [*prompt, 40, 41, 42, 43]
        cache.give_back(hybrid_cache(prompt, checkpoints=(4, 8)), prompt)
        cache.give_back(hybrid_cache(answer, checkpoints=()), answer)
        assert len(cache) == 1 and sorted(book_of(cache.entries[0].cache).at) == [4, 8, 10]
        reuse = cache.take([*prompt, 77, 78])
        assert reuse.cached == 10 and state_of(reuse.cache) == 10.0

    def test_only_the_latest_turn_end_between_two_periodic_checkpoints_is_kept(self):
        """Every turn of a conversation folds the previous one's end in as a checkpoint; between two periodic
        ones (every 4 here) only the latest stays, so a long conversation's copies stay bounded."""
        cache = pc(new_cache=empty_hybrid)
        ids = list(range(1, 10))
        cache.give_back(hybrid_cache(ids, checkpoints=(4, 8)), ids)
        for extra in (10, 11):
            ids = [*ids, 100 + extra]
            cache.give_back(hybrid_cache(ids, checkpoints=()), ids)
        assert sorted(cache.entries[0].book.at) == [4, 8, 10]

    def test_shared_checkpoints_are_counted_once(self):
        cache = pc(new_cache=empty_hybrid, min_tokens=2)
        ids = list(range(1, 15))
        cache.give_back(hybrid_cache(ids, checkpoints=(4, 8)), ids)
        one = cache.bytes_held
        other = [*ids[:9], 90, 91, 92]
        cache.give_back(hybrid_cache(other, checkpoints=()), other)  # shares 9 tokens: checkpoints 4 and 8
        assert sorted(book_of(cache.entries[1].cache).at) == [4, 8]
        own = cache.entries[1].nbytes
        assert cache.bytes_held == one + own
