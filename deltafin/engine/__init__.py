"""Engines behind one interface, and the front (admission, memo) that serving talks to.

Serving imports from here only: `EngineFront`, `GenerationStream`, the event types and the interface.
Concrete engines (`deltafin.engine.local.engine`, the upstream adapters) are built by `deltafin.app.services`.
"""

from deltafin.engine.events import Finished, GenerationJob, PromptLogprobs, TextDelta, TokenLogprob
from deltafin.engine.front import EngineFront
from deltafin.engine.interface import EngineCapabilities, EngineClient, Readiness
from deltafin.engine.stream import GenerationStream

__all__ = [
    "EngineCapabilities",
    "EngineClient",
    "EngineFront",
    "Finished",
    "GenerationJob",
    "GenerationStream",
    "PromptLogprobs",
    "Readiness",
    "TextDelta",
    "TokenLogprob",
]
