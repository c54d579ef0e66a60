from deltafin.engine.memo import ResponseMemo


class TestResponseMemo:
    def test_returns_what_was_put(self):
        memo = ResponseMemo(2)
        memo.put("a", [1, 2])
        assert memo.get("a") == (1, 2)

    def test_evicts_least_recently_used(self):
        memo = ResponseMemo(2)
        memo.put("a", [1])
        memo.put("b", [2])
        memo.get("a")
        memo.put("c", [3])
        assert memo.get("b") is None
        assert memo.get("a") == (1,)
        assert memo.get("c") == (3,)

    def test_zero_entries_disables_it(self):
        memo = ResponseMemo(0)
        memo.put("a", [1])
        assert memo.get("a") is None
