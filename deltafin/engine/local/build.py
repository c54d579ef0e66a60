"""The built-in engine's builder, named by conf/engine/local.yaml's `_target_`."""

from __future__ import annotations

from deltafin.config import DeltafinConfig
from deltafin.engine.interface import EngineClient


def build_local_engine(config: DeltafinConfig) -> EngineClient:
    """The built-in torch engine over model.path's weights (this blocks: seconds to minutes)."""
    import torch

    from deltafin.engine.local.engine import LocalEngine
    from deltafin.engine.weights.loader import load_model

    # Only the engine's owner thread runs torch with several threads (LocalEngine._loop says why); loading here
    # with one keeps this thread from growing an OpenMP team of its own.
    threads = config.placement.num_threads or torch.get_num_threads()
    torch.set_num_threads(1)
    loaded = load_model(config.model, config.placement, max_batch=config.engine.max_batch)
    if loaded.experts is not None and config.placement.num_threads is None:
        threads = loaded.experts.compute_threads(threads)  # a core for the expert reads' copies
    return LocalEngine(
        loaded,
        threads=threads,
        max_batch=config.engine.max_batch,
        prefill_chunk=config.engine.prefill_chunk_tokens,
        prefix_cache_min_tokens=config.server.prefix_cache.min_tokens if config.server.prefix_cache.enabled else None,
    )


build_local_engine.engine_name = "local"  # type: ignore[attr-defined]  # for the log line, before the engine exists
