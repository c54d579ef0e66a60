"""How many slots `placement.experts.pool_mb` buys, and whether that is enough to serve a full batch.

The rule. A layer's experts are computed together, so every expert the layer's rows chose must sit in the pool
at once: for a decode step of `engine.max_batch` rows that is at most min(E, max_batch x top_k) experts of one
layer (the layers run one after another, so one layer's set at a time). With prefetch on, the next layer's
predicted experts are read into other slots while this layer's are pinned: the same number again. A pool
below that would evict experts of the running step to make room for others of the same step, so it is refused
at start-up, one line. (A prefill chunk can route to more experts than a decode step; it runs in waves of
whatever fits, so it never needs more than the pool has.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltafin.engine.experts.model import ModelShape
from deltafin.engine.experts.slots import slots_class

MIB = 1 << 20


class PoolTooSmall(ValueError):
    """`placement.experts.pool_mb` cannot hold one step's experts (one line naming the key)."""


@dataclass(frozen=True)
class PoolPlan:
    slots: int
    slot_bytes: int
    per_layer: int  # experts of one layer a full decode step can need
    required: int  # slots the rule asks for
    total_experts: int  # routed experts in the model (layers x E)

    @property
    def pool_bytes(self) -> int:
        return self.slots * self.slot_bytes


def plan_pool(
    shape: ModelShape,
    *,
    pool_mb: int,
    prefetch: bool,
    dtype: torch.dtype,
    quantize: str,
    max_batch: int,
    slot_bytes: int | None = None,
) -> PoolPlan:
    """`slot_bytes`: a packed record's size (a published quantized checkpoint), else the slots' of `quantize`."""
    if slot_bytes is None:
        slot_bytes = slots_class(quantize).slot_bytes(shape.gate_up_shape, shape.down_shape, dtype)
    total = shape.layers * shape.experts
    slots = min(pool_mb * MIB // slot_bytes, total)  # more slots than experts would never be used
    per_layer = min(shape.experts, max_batch * shape.top_k)
    required = min(per_layer * (2 if prefetch else 1), total)
    if slots < required:
        need_mb = -(-required * slot_bytes // MIB)
        extra = " and as many again for prefetch" if prefetch else ""
        hint = ", turn placement.experts.prefetch off" if prefetch and slots >= per_layer else ""
        raise PoolTooSmall(
            f"placement.experts.pool_mb: {pool_mb} MiB holds {slots} experts of {slot_bytes / MIB:.2f} MiB; a decode "
            f"step of engine.max_batch={max_batch} rows needs up to {per_layer} experts of a layer resident{extra} "
            f"({required} slots, {need_mb} MiB): raise pool_mb, lower engine.max_batch{hint} or set pool_mb=0 (all resident)"
        )
    return PoolPlan(slots, slot_bytes, per_layer, required, total)
