"""The expert pool: serve a MoE whose routed experts do not fit in memory (`placement.experts.*`).

Dense weights (embeddings, attention, norms, routers, shared experts, the LM head) load as usual; routed experts
stay in the checkpoint and are read, only the chosen experts' bytes, into a fixed set of slots on demand
(`pool.py`), evicted by policy (`policy.py`), prefetched by applying the next layer's router early. The model
classes are transformers' own: the pool is an implementation in their experts interface (`forward.py`).

    load_pooled_model(folder, placement, ...)   the model and its pool (one call from engine/weights/loader.py)
    check_pool(model_cfg, placement, max_batch)  start-up check of pool_mb against the model (one line)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog
import torch

from deltafin.engine.experts.checkpoint import CheckpointLayoutError
from deltafin.engine.experts.model import NotPoolable, experts_modules, meta_model, model_shape
from deltafin.engine.experts.pool import ExpertPool, PoolCounters, PoolStats
from deltafin.engine.experts.sizing import PoolPlan, PoolTooSmall, plan_pool
from deltafin.engine.models import ModelSource

log = structlog.get_logger("deltafin.engine")

__all__ = [
    "ExpertPool",
    "PoolCounters",
    "PoolStats",
    "PoolPlan",
    "PoolTooSmall",
    "NotPoolable",
    "CheckpointLayoutError",
    "charge",
    "check_pool",
    "load_pooled_model",
]

#: LFRU's half-life, in forward passes (a score halves when its expert went unused for this many passes)
LFRU_HALF_LIFE_PASSES = 8


def check_pool(
    folder: Path,
    placement: Any,
    *,
    dtype: torch.dtype,
    trust_remote_code: bool,
    max_batch: int,
    model_source: ModelSource | None = None,
) -> PoolPlan:
    """The pool `placement.experts` asks for, checked against the model's config (no weights read);
    PoolTooSmall / NotPoolable with a one-line reason. `model_source`: how the model is built (None:
    transformers' Auto classes on the folder)."""
    _, _, meta = meta_model(folder, dtype=dtype, trust_remote_code=trust_remote_code, source=model_source)
    shape = model_shape(meta, experts_modules(meta))
    return plan_pool(
        shape,
        pool_mb=placement.experts.pool_mb,
        prefetch=placement.experts.prefetch,
        dtype=dtype,
        quantize=placement.quantize,
        max_batch=max_batch,
    )


def load_pooled_model(
    folder: Path,
    placement: Any,
    *,
    dtype: torch.dtype,
    trust_remote_code: bool,
    max_batch: int,
    cache_dir: Path | None = None,
    model_source: ModelSource | None = None,
) -> tuple[Any, ExpertPool]:
    """The model with its dense weights loaded and its routed experts served by a new pool. With int8 slots,
    `placement.experts.quantized_copy` and a `cache_dir`, misses read the int8 copy of the experts there
    (written at the first boot); otherwise they read the checkpoint."""
    from deltafin.engine.experts.forward import attach
    from deltafin.engine.experts.model import load_dense, router_of
    from deltafin.engine.experts.policy import make_policy
    from deltafin.engine.experts.slots import slots_class
    from deltafin.engine.experts.store import CheckpointSource, open_int8_copy

    model, experts, index, shape = load_dense(
        folder, dtype=dtype, trust_remote_code=trust_remote_code, source=model_source
    )
    settings = placement.experts
    plan = plan_pool(
        shape,
        pool_mb=settings.pool_mb,
        prefetch=settings.prefetch,
        dtype=dtype,
        quantize=placement.quantize,
        max_batch=max_batch,
    )
    slots = slots_class(placement.quantize)(
        plan.slots, index.gate_up_shape, index.down_shape, dtype, torch.device(placement.device)
    )
    source: Any = None
    if slots.kind == "int8" and settings.quantized_copy and cache_dir is not None:
        try:
            source = open_int8_copy(folder, index, slots, cache_dir, direct=settings.direct_io)
        except OSError as exc:  # a read-only or full cache folder: serve, quantizing each miss instead
            log.warning("expert_int8_copy_unavailable", cache_dir=str(cache_dir), error=str(exc))
    if source is None:
        source = CheckpointSource(index)
    policy = make_policy(settings.policy, plan.slots, half_life=LFRU_HALF_LIFE_PASSES * len(index.layers))
    pool = ExpertPool(
        index,
        slots,
        source,
        policy,
        slot_bytes=plan.slot_bytes,
        routers=[router_of(model, name) for name in index.layers],
        prefetch=settings.prefetch,
        readers=settings.readers,
    )
    attach(model, experts, pool)
    log.info(
        "expert_pool",
        slots=plan.slots,
        slot_mib=round(plan.slot_bytes / (1 << 20), 3),
        pool_mib=round(plan.pool_bytes / (1 << 20), 1),
        experts=plan.total_experts,
        experts_mib=round(index.total_bytes / (1 << 20), 1),
        policy=settings.policy,
        prefetch=settings.prefetch,
        format=slots.kind,
        source=type(source).__name__,
        direct_io=getattr(source, "direct", False),
    )
    return model, pool


def charge(timings: dict[str, float], delta: PoolCounters, *, share: int, decode: bool) -> None:
    """Add a 1/`share` part of some pool work (a prefill's, or a decode step's shared by `share` rows) to one
    row's `timings`, which reach its request's log line; decode bytes apart, for bytes per generated token."""
    if not delta.hits and not delta.misses:
        return
    timings["expert_hits"] = timings.get("expert_hits", 0.0) + delta.hits / share
    timings["expert_misses"] = timings.get("expert_misses", 0.0) + delta.misses / share
    key = "expert_decode_bytes" if decode else "expert_prefill_bytes"
    timings[key] = timings.get(key, 0.0) + delta.bytes_read / share
