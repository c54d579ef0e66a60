"""RequestStats: what one request's access-log line reports about its tokens."""

from deltafin.engine.events import TextDelta
from deltafin.serving.context import RequestStats


def test_ttft_is_the_first_token_even_when_its_text_is_held_back():
    """A token whose text waits (a character's first bytes, a possible stop string) is still the first token:
    a short answer whose text all came out at its end had no time to first token in its log line."""
    stats = RequestStats()
    stats.saw(TextDelta(choice=0, text="", token_ids=(7,)))
    first = stats.ttft_s
    assert first is not None and stats.generated_tokens == 1
    stats.saw(TextDelta(choice=0, text="hé", token_ids=(8,)))
    assert stats.ttft_s == first


def test_an_event_without_tokens_is_no_first_token():
    stats = RequestStats()
    stats.saw(TextDelta(choice=0, text=""))
    assert stats.ttft_s is None
