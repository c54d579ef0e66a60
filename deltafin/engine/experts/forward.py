"""The pool's experts implementation, registered in transformers' experts interface.

Every experts class built with `@use_experts_implementation` (DeepseekV3 / Kimi K2, Kimi Linear, Glm4Moe,
Qwen3-MoE, Mixtral, ...) calls `ALL_EXPERTS_FUNCTIONS.get_interface(config._experts_implementation)(self,
hidden, top_k_index, top_k_weights)`. Registering one function under `deltafin_pool` and selecting it with
`model.set_experts_implementation` swaps the routed-experts computation of every such module, prefill windows
and decode steps of any batch alike, without touching the model classes.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.integrations.moe import ExpertsInterface

IMPLEMENTATION = "deltafin_pool"


@torch.compiler.disable  # the pool's bookkeeping is Python; a compiled step calls it as one opaque function
def pooled_experts_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    binding = getattr(self, "_deltafin_pool", None)
    if binding is None:
        raise RuntimeError(f"{type(self).__name__} runs the expert pool's implementation without a pool attached")
    pool, layer = binding
    return pool.forward(layer, self, hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register(IMPLEMENTATION, pooled_experts_forward)


def attach(model: Any, experts: dict[str, Any], pool: Any) -> None:
    """Route every experts module of `model` through `pool` (module number = its layer in the pool's index)."""
    for layer, module in enumerate(experts.values()):
        module._deltafin_pool = (pool, layer)
    model.set_experts_implementation(IMPLEMENTATION)
