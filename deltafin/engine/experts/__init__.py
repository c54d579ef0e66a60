"""The expert pool: serve a MoE whose routed experts do not fit in memory (`placement.experts.*`).

Dense weights (embeddings, attention, norms, routers, shared experts, the LM head) load as usual; routed experts
stay in the checkpoint and are read, only the chosen experts' bytes, into a fixed set of slots on demand
(`pool.py`), evicted by policy (`policy.py`), prefetched by applying the next layer's router early. The model
classes are transformers' own: the pool is an implementation in their experts interface (`forward.py`).
A published quantized checkpoint (int4, MXFP4, FP8 blocks: `deltafin.engine.quant.formats`) keeps its experts
packed, pooled (`slots.PackedSlots`) or all resident (`resident.py`), through the same hook.

    load_pooled_model(folder, placement, ...)   the model and its pool (one call from engine/weights/loader.py)
    load_packed_model(folder, ...)              a published quantized checkpoint with every expert resident
    check_pool(folder, placement, ...)          start-up check of pool_mb against the model (one line)

The experts hook's contract (what a model class needs for its routed experts to be served here, pooled or
resident; transformers' MoE classes built with `@use_experts_implementation` meet it, and a model of the
engine's own, e.g. Kimi K3's, meets it by the same names):

- the experts module has `_is_expert_parallel` and `gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] parameters
  (on the meta device their shapes are all that is read), gate rows first in gate_up (`is_concatenated`, no
  bias, not transposed), and `_apply_gate(gate_up_out [n, 2I]) -> [n, I]` (its activation: SiLU, or K3's SiTU);
- its forward calls `ALL_EXPERTS_FUNCTIONS.get_interface(config._experts_implementation)(self, hidden [T, H],
  top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`, so `model.set_experts_implementation("deltafin_pool")`
  routes it to `forward.pooled_experts_forward`, which calls the binding `attach` put on the module
  (`module._deltafin_pool = (binding, layer)`; binding: an `ExpertPool` or `ResidentExperts`);
- its router is the `gate` of the module holding it, `gate(hidden) -> (logits, weights, indices)` (prefetch
  applies the next layer's early; a model without one is served, unprefetched);
- the checkpoint's per-expert keys map onto `gate_up_proj` / `down_proj` through transformers' conversion
  mapping for the model type (`MergeModulelist`, then `Concatenate` of gate and up): quantized keys are read
  by the same mapping (`...w1.weight_packed` is placed where `...w1.weight` would go).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog
import torch

from deltafin.engine.experts.checkpoint import CheckpointLayoutError
from deltafin.engine.experts.model import CheckpointView, NotPoolable, experts_modules, meta_model, model_shape
from deltafin.engine.experts.pool import ExpertPool, PoolCounters, PoolStats
from deltafin.engine.experts.records import packed_slot_bytes
from deltafin.engine.experts.sizing import PoolPlan, PoolTooSmall, plan_pool

log = structlog.get_logger("deltafin.engine")

__all__ = [
    "CheckpointView",
    "ExpertPool",
    "PoolCounters",
    "PoolStats",
    "PoolPlan",
    "PoolTooSmall",
    "NotPoolable",
    "CheckpointLayoutError",
    "charge",
    "check_pool",
    "load_packed_model",
    "load_pooled_model",
]

#: a float checkpoint built by transformers' Auto classes from its config.json
PLAIN = CheckpointView()

#: LFRU's half-life, in forward passes (a score halves when its expert went unused for this many passes)
LFRU_HALF_LIFE_PASSES = 8


def check_pool(
    folder: Path,
    placement: Any,
    *,
    dtype: torch.dtype,
    trust_remote_code: bool,
    max_batch: int,
    view: CheckpointView = PLAIN,
) -> PoolPlan:
    """The pool `placement.experts` asks for, checked against the model's config (and, for a published
    quantized checkpoint, the headers of its files: the packed records' size; no weights read);
    PoolTooSmall / NotPoolable with a one-line reason. `view.source`: how the model is built (None:
    transformers' Auto classes on the folder)."""
    source = view.source
    _, _, meta = meta_model(folder, dtype=dtype, trust_remote_code=trust_remote_code, source=source)
    experts = experts_modules(meta)
    shape = model_shape(meta, experts)
    slot_bytes = None
    if view.published is not None:
        from deltafin.engine.experts.checkpoint import build_index

        index = build_index(
            folder,
            meta,
            experts,
            key_mapping=source.key_mapping if source is not None else None,
            ignored=source.ignored if source is not None else (),
            published=view.published,
        )
        if index.packed is not None:
            slot_bytes = packed_slot_bytes(index.packed, index.gate_up_shape, index.down_shape)
    return plan_pool(
        shape,
        pool_mb=placement.experts.pool_mb,
        prefetch=placement.experts.prefetch,
        dtype=dtype,
        quantize=placement.quantize,
        max_batch=max_batch,
        slot_bytes=slot_bytes,
    )


def load_pooled_model(
    folder: Path,
    placement: Any,
    *,
    dtype: torch.dtype,
    trust_remote_code: bool,
    max_batch: int,
    cache_dir: Path | None = None,
    view: CheckpointView = PLAIN,
) -> tuple[Any, ExpertPool]:
    """The model with its dense weights loaded and its routed experts served by a new pool. With
    `placement.experts.quantized_copy` and a `cache_dir`, int8 and packed slots' misses read the copy of the
    experts in their records there (written at the first boot); otherwise they read the checkpoint."""
    from deltafin.engine.experts.forward import attach
    from deltafin.engine.experts.model import load_dense, router_of
    from deltafin.engine.experts.policy import make_policy
    from deltafin.engine.experts.slots import PackedSlots, slots_class
    from deltafin.engine.experts.store import CheckpointSource, open_record_copy

    model, experts, index, shape = load_dense(folder, dtype=dtype, trust_remote_code=trust_remote_code, view=view)
    if shape is None:
        raise NotPoolable("the model has no routed experts")
    settings = placement.experts
    device = torch.device(placement.device)
    slot_bytes = None
    if index.packed is not None:
        slot_bytes = packed_slot_bytes(index.packed, index.gate_up_shape, index.down_shape)
    plan = plan_pool(
        shape,
        pool_mb=settings.pool_mb,
        prefetch=settings.prefetch,
        dtype=dtype,
        quantize=placement.quantize,
        max_batch=max_batch,
        slot_bytes=slot_bytes,
    )
    if index.packed is not None:
        slots: Any = PackedSlots(plan.slots, index.gate_up_shape, index.down_shape, index.packed, device)
    else:
        slots = slots_class(placement.quantize)(plan.slots, index.gate_up_shape, index.down_shape, dtype, device)
    source: Any = None
    if slots.kind != "float" and settings.quantized_copy and cache_dir is not None:
        try:
            source = open_record_copy(folder, index, slots, cache_dir, direct=settings.direct_io)
        except OSError as exc:  # a read-only or full cache folder: serve, reading the checkpoint instead
            log.warning("expert_copy_unavailable", cache_dir=str(cache_dir), format=slots.kind, error=str(exc))
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


def load_packed_model(
    folder: Path, placement: Any, *, dtype: torch.dtype, trust_remote_code: bool, view: CheckpointView
) -> Any:
    """A published quantized checkpoint with every weight in memory as stored: its quantized dense Linears as
    packed modules, its routed experts (if any) in `ResidentExperts` behind the experts hook."""
    from deltafin.engine.experts.forward import attach
    from deltafin.engine.experts.model import load_dense
    from deltafin.engine.experts.resident import ResidentExperts

    model, experts, index, _ = load_dense(folder, dtype=dtype, trust_remote_code=trust_remote_code, view=view)
    if index.packed is not None:
        resident = ResidentExperts(index, torch.device(placement.device))
        attach(model, experts, resident)
        log.info(
            "packed_experts_resident",
            format=index.packed.format,
            experts=len(index.layers) * index.experts,
            mib=round(resident.nbytes / (1 << 20), 1),
        )
    elif experts:  # float experts in a checkpoint quantized elsewhere: transformers' parameters, loaded whole
        raise NotPoolable(
            f"{next(iter(experts))}: the routed experts of this {view.published.title if view.published else ''} "
            "checkpoint are float: serve them with placement.experts.pool_mb > 0"
        )
    log.info("packed_dense_modules", count=len(index.dense_packed))
    return model


def charge(timings: dict[str, float], delta: PoolCounters, *, share: int, decode: bool) -> None:
    """Add a 1/`share` part of some pool work (a prefill's, or a decode step's shared by `share` rows) to one
    row's `timings`, which reach its request's log line; decode bytes apart, for bytes per generated token."""
    if not delta.hits and not delta.misses:
        return
    timings["expert_hits"] = timings.get("expert_hits", 0.0) + delta.hits / share
    timings["expert_misses"] = timings.get("expert_misses", 0.0) + delta.misses / share
    key = "expert_decode_bytes" if decode else "expert_prefill_bytes"
    timings[key] = timings.get(key, 0.0) + delta.bytes_read / share
