from deltafin.engine.kv.prefix_cache import PrefixCache


class FakeCache:
    def __init__(self):
        self.removed = 0

    def crop(self, n):
        self.removed = -n


class TestPrefixCache:
    def test_fresh_cache_when_nothing_is_shared(self):
        made = []
        pc = PrefixCache(lambda: made.append(FakeCache()) or made[-1], min_reuse=2)
        cache, reused = pc.take([1, 2, 3])
        assert reused == 0 and cache is made[0]

    def test_reuses_the_shared_prefix_and_crops_to_it(self):
        pc = PrefixCache(FakeCache, min_reuse=2)
        old = FakeCache()
        pc.give_back(old, [1, 2, 3, 4, 5])
        cache, reused = pc.take([1, 2, 3, 9])
        assert cache is old and reused == 3 and old.removed == 2

    def test_always_leaves_one_prompt_token_to_run(self):
        pc = PrefixCache(FakeCache, min_reuse=1)
        old = FakeCache()
        pc.give_back(old, [1, 2, 3, 4])
        _, reused = pc.take([1, 2, 3])
        assert reused == 2

    def test_taken_cache_is_gone_until_given_back(self):
        pc = PrefixCache(FakeCache, min_reuse=1)
        pc.give_back(FakeCache(), [1, 2, 3])
        pc.take([1, 2, 3, 4])
        _, reused = pc.take([1, 2, 3, 4])
        assert reused == 0

    def test_short_prefixes_are_not_worth_reusing(self):
        pc = PrefixCache(FakeCache, min_reuse=16)
        pc.give_back(FakeCache(), list(range(10)))
        _, reused = pc.take(list(range(12)))
        assert reused == 0


class StateCache(FakeCache):
    """A cache with a linear-attention layer: its recurrent state holds exactly the tokens it saw."""

    def __init__(self):
        from transformers.cache_utils import LinearAttentionLayer

        super().__init__()
        self.layers = [LinearAttentionLayer()]

    def crop(self, n):
        raise AssertionError("a recurrent state cannot be cut back")


class TestRecurrentStateEntries:
    def test_reused_only_when_all_its_tokens_start_the_prompt(self):
        pc = PrefixCache(StateCache, min_reuse=2)
        saved = StateCache()
        pc.give_back(saved, [1, 2, 3, 4])
        cache, reused = pc.take([1, 2, 3, 4, 5, 6])
        assert cache is saved and reused == 4

    def test_a_partial_match_is_not_reused(self):
        pc = PrefixCache(StateCache, min_reuse=2)
        saved = StateCache()
        pc.give_back(saved, [1, 2, 3, 4, 5])
        cache, reused = pc.take([1, 2, 3, 4, 9, 9])
        assert cache is not saved and reused == 0
        _, reused = pc.take([1, 2, 3, 4, 5])  # the same prompt: one token must run, and the state is past it
        assert reused == 0

    def test_a_shorter_state_stays_beside_one_that_extends_it(self):
        """An attention-only entry that is a prefix of a newer one goes (the newer one crops to it); a state
        does not: a prompt that leaves the newer entry's path after the shorter one can only use the shorter."""
        pc = PrefixCache(StateCache, min_reuse=2)
        short, long = StateCache(), StateCache()
        pc.give_back(short, [1, 2, 3])
        pc.give_back(long, [1, 2, 3, 4, 5])
        assert len(pc) == 2
        cache, reused = pc.take([1, 2, 3, 7, 8])
        assert cache is short and reused == 3
        pc.give_back(StateCache(), [1, 2, 3, 4, 5])  # an identical one replaces the old
        assert len(pc) == 1
