from deltafin.engine.text.detokenizer import IncrementalDetokenizer


class TestIncrementalDetokenizer:
    def test_pieces_join_to_the_whole_decode(self, engine):
        tokenizer = engine.tokenizer
        text = "Héllo wörld — naïve café 👋 done."
        ids = tokenizer(text, add_special_tokens=False).input_ids
        detok = IncrementalDetokenizer(tokenizer)
        pieces = [detok.push(i) for i in ids]
        assert "".join(pieces) == tokenizer.decode(ids)
        assert all("\ufffd" not in piece for piece in pieces)

    def test_holds_back_a_split_multibyte_character(self, engine):
        tokenizer = engine.tokenizer
        ids = tokenizer("👋", add_special_tokens=False).input_ids
        assert len(ids) > 1, "the emoji must span several byte-level tokens for this test"
        detok = IncrementalDetokenizer(tokenizer)
        pieces = [detok.push(i) for i in ids]
        assert pieces[:-1] == [""] * (len(ids) - 1)
        assert pieces[-1] == "👋"
