from deltafin.engine.text.stops import StopMatcher


class TestStopMatcher:
    def test_no_stops_passes_text_through(self):
        matcher = StopMatcher(())
        assert matcher.feed("hello") == "hello"

    def test_cuts_at_first_match_within_one_chunk(self):
        matcher = StopMatcher(("END",))
        assert matcher.feed("abcENDdef") == "abc"
        assert matcher.matched == "END"

    def test_holds_back_a_possible_start_across_chunks(self):
        matcher = StopMatcher(("END",))
        assert matcher.feed("abcE") == "abc"
        assert matcher.feed("N") == ""
        assert matcher.feed("D tail") == ""
        assert matcher.matched == "END"

    def test_releases_held_text_when_it_is_not_a_stop(self):
        matcher = StopMatcher(("END",))
        assert matcher.feed("abcEN") == "abc"
        assert matcher.feed("X") == "ENX"
        assert matcher.matched is None

    def test_flush_returns_what_was_held_at_the_end(self):
        matcher = StopMatcher(("END",))
        assert matcher.feed("abE") == "ab"
        assert matcher.flush() == "E"

    def test_earliest_of_several_stops_wins(self):
        matcher = StopMatcher(("world", "lo"))
        assert matcher.feed("hello world") == "hel"
        assert matcher.matched == "lo"
