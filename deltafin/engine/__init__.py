"""Engines behind one interface, and the front (admission, memo) that serving talks to.

Serving imports from here only: `EngineFront`, `GenerationStream`, the event types and the interface.
Each engine is built by the callable its `engine._target_` names (conf/engine/*.yaml: `local.build`, the
`upstream` builders), which `deltafin.app.services.build_engine` calls. The rooms (local/, upstream/, weights/,
experts/, llama/, models/, kv/, quant/, kernels/, text/) are described in docs/architecture.md ("Engine").
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
