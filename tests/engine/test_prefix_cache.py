from deltafin.engine.prefix_cache import PrefixCache


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
