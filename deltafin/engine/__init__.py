"""The single-lock torch/transformers engine: load, queue, generate tokens, detokenize, memoize."""

from deltafin.engine.engine import Engine
from deltafin.engine.events import Finished, GenerationJob, PromptLogprobs, TextDelta, TokenLogprob

__all__ = ["Engine", "Finished", "GenerationJob", "PromptLogprobs", "TextDelta", "TokenLogprob"]
