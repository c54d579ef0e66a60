"""The built-in engine's builder, named by conf/engine/local.yaml's `_target_`."""

from __future__ import annotations

import copy
from typing import Any

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
    speculative = config.engine.speculative
    draft = None
    if speculative.method == "draft":  # a second model, loaded as the main one is (placement, GGUF blocks)
        draft_model = copy.deepcopy(config.model)
        draft_model.path, draft_model.context_length = str(speculative.draft_path), None
        draft = load_model(draft_model, config.placement)
    return LocalEngine(
        loaded,
        threads=threads,
        max_batch=config.engine.max_batch,
        prefill_chunk=config.engine.prefill_chunk_tokens,
        prefix_cache=prefix_cache_settings(config, loaded),
        speculative=speculative,
        draft=draft,
    )


def prefix_cache_settings(config: DeltafinConfig, loaded: Any) -> Any:
    """server.prefix_cache as the engine's settings; the disk tier's namespace says what the model is."""
    from deltafin.engine.kv.disk_tier import DiskSettings
    from deltafin.engine.kv.prefix_cache import PrefixCacheSettings
    from deltafin.engine.local.cache_identity import cache_identity

    options = config.server.prefix_cache
    disk = None
    if options.enabled and options.disk_dir is not None:
        namespace, facts = cache_identity(config, loaded)
        disk = DiskSettings(
            root=options.disk_dir,
            max_bytes=options.disk_max_bytes,
            block_tokens=options.disk_block_tokens,
            namespace=namespace,
            facts=tuple(facts.items()),
        )
    return PrefixCacheSettings(
        enabled=options.enabled,
        min_tokens=options.min_tokens,
        max_bytes=options.max_bytes,
        state_every_tokens=options.state_every_tokens,
        disk=disk,
    )


build_local_engine.engine_name = "local"  # type: ignore[attr-defined]  # for the log line, before the engine exists
