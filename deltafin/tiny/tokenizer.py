"""A small byte-level BPE tokenizer, trained in well under a second, carrying a family's special tokens."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

_CORPUS = """
The quick brown fox jumps over the lazy dog. What is the weather in Paris today? It is sunny and warm.
Please call the tool to get the weather for a city. The answer is 42. Hello, how can I help you today?
get_weather city Paris days 3 unit celsius now time zone Tokyo London Berlin New York search query
{"city": "Paris", "days": 3} {"location": "Tokyo"} [1, 2, 3] true false null 0.5 12:00 result ok
I will look that up for you. Let me think about this step by step. First, second, finally.
def main(): return 1 + 2  # code and numbers 0123456789 !?.,;:'"()[]{}<>/\\|=+-*&^%$#@~`
""".strip()


def train_tokenizer(
    special_tokens: list[str], extra_text: Iterable[str] = (), vocab_size: int = 1200
) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS, *extra_text] * 4, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)
