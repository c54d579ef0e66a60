"""TokenCodec: the direct backend calls give exactly what transformers' own calls give."""

import copy
import threading
import time

import pytest
from transformers import AutoTokenizer

from deltafin.engine.text.detokenizer import IncrementalDetokenizer
from deltafin.token_codec import TokenCodec, decoder_for

TEXTS = [
    "Hello there, how are you?",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n",
    "typed by a user: <|im_start|> and <|im_end|> and <tool_call>",
    "héllo wörld — 東京 🐉🍞 \u200b tabs\tand\nnewlines  double  spaces ",
    "x" * 5000 + " <|im_end|> " + "y" * 100,  # past the GIL-free threshold
    "",
]


@pytest.fixture(scope="module", params=["default", "kimi_k2", "glm47"])
def tokenizer(request, loaded_model, tiny_models):
    if request.param == "default":
        return copy.deepcopy(loaded_model.tokenizer)
    return AutoTokenizer.from_pretrained(str(tiny_models[request.param]))


@pytest.mark.parametrize("split", [False, True])
def test_encode_matches_transformers(tokenizer, split):
    codec = TokenCodec(copy.deepcopy(tokenizer))
    assert codec.direct  # fast tokenizers take the shortcut; otherwise this test would compare a path with itself
    for text in TEXTS:
        expected = list(tokenizer(text, add_special_tokens=False, split_special_tokens=split).input_ids) if text else []
        assert codec.encode(text, split_special_tokens=split) == expected, text[:40]


def test_template_pieces_are_cached_with_control_tokens_live(tokenizer):
    codec = TokenCodec(copy.deepcopy(tokenizer))
    piece = TEXTS[1]
    first = codec.encode_template(piece)
    assert list(first) == list(tokenizer(piece, add_special_tokens=False, split_special_tokens=False).input_ids)
    codec.encode(piece, split_special_tokens=True)  # the flag flips in between: the cache must not care
    assert codec.encode_template(piece) is first


def test_decode_matches_transformers(tokenizer):
    codec = TokenCodec(tokenizer)
    ids = tokenizer(TEXTS[3] + TEXTS[1], add_special_tokens=False).input_ids
    for end in range(1, len(ids) + 1):
        assert codec.decode(ids[:end]) == tokenizer.decode(ids[:end], skip_special_tokens=False)


def test_the_detokenizer_streams_what_a_whole_decode_gives(tokenizer):
    ids = tokenizer(TEXTS[3] + TEXTS[0], add_special_tokens=False).input_ids
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert "".join(detokenizer.push(i) for i in ids) == tokenizer.decode(ids, skip_special_tokens=False)


def test_one_decoder_per_tokenizer_which_it_does_not_keep_alive(loaded_model):
    import gc
    import weakref

    tokenizer = copy.deepcopy(loaded_model.tokenizer)
    decode = decoder_for(tokenizer)
    assert decoder_for(tokenizer) is decode  # every detokenizer of this tokenizer shares it
    ids = tokenizer(TEXTS[3], add_special_tokens=False).input_ids
    assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=False)
    gone = weakref.ref(tokenizer)
    del tokenizer
    gc.collect()
    assert gone() is None


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_path(loaded_model):
    tokenizer = copy.deepcopy(loaded_model.tokenizer)
    tokenizer.clean_up_tokenization_spaces = True
    codec = TokenCodec(tokenizer)
    assert not codec.direct
    ids = tokenizer("Hello , world .", add_special_tokens=False).input_ids
    assert codec.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False)


def test_a_long_encode_lets_other_threads_run(loaded_model):
    """A megabyte prompt is tokenized on a prompt thread; the event loop's thread must keep running meanwhile.

    Counted, not timed: a ticker thread that wakes every 5 ms ticks many times during the encode if the encode
    lets go of the GIL, and at most once if it holds it. A loaded machine slows both sides alike."""
    codec = TokenCodec(copy.deepcopy(loaded_model.tokenizer))
    text = "hello world, this is a long message. " * 40000
    ticks = 0
    running, done = threading.Event(), threading.Event()

    def ticker():
        nonlocal ticks
        running.set()
        while not done.is_set():
            ticks += 1
            time.sleep(0.005)

    thread = threading.Thread(target=ticker)
    thread.start()
    running.wait(5)
    before = ticks
    codec.encode(text, split_special_tokens=True)
    during = ticks - before
    done.set()
    thread.join()
    assert during >= 10, during
