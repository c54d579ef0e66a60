"""SamplingParams -> the knobs vLLM and SGLang share (OpenAI names plus vLLM's extensions)."""

from __future__ import annotations

from typing import Any

from deltafin.protocol.sampling import SamplingParams


def common_knobs(params: SamplingParams) -> dict[str, Any]:
    """Every knob explicitly, so the upstream's generation_config defaults never change the tokens."""
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "min_p": params.min_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "ignore_eos": params.ignore_eos,
    }
