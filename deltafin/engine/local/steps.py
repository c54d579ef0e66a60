"""Which decode step runs a model: the first entry of `STEPS` that covers it.

Each entry takes the model (and whether the step may be compiled) and returns a step, callable as
`generator.decode_step` is, or None where it does not apply. The order is the order of speed: a Llama
model loaded with its GGUF blocks runs its whole step in C; a float or int8 Llama runs the fused torch step
(static shapes under `placement.compile`); every other model runs transformers' own forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deltafin.engine.llama.fused import fused_llama_step
from deltafin.engine.llama.fused_static import StaticFusedStep
from deltafin.engine.llama.native import native_llama_step
from deltafin.engine.local.generator import compiled_decode_step, decode_step

StepBuilder = Callable[[Any, bool, str], Any]


def _native(model: Any, compile: bool, backend: str) -> Any:
    return native_llama_step(model)  # one C call per step: nothing to compile


def _fused(model: Any, compile: bool, backend: str) -> Any:
    fused = fused_llama_step(model)
    if fused is None or not compile:
        return fused
    return StaticFusedStep(fused, backend=backend)


def _transformers(model: Any, compile: bool, backend: str) -> Any:
    return compiled_decode_step(backend, decode_step) if compile else decode_step


#: (name, builder), fastest first; the last covers every model
STEPS: list[tuple[str, StepBuilder]] = [("native", _native), ("fused", _fused), ("transformers", _transformers)]


def decode_step_for(model: Any, *, compile: bool = False, backend: str = "inductor") -> Any:
    """The decode step of the first entry of `STEPS` that covers `model`."""
    for _, build in STEPS:
        step = build(model, compile, backend)
        if step is not None:
            return step
    raise AssertionError("the transformers step covers every model")
