"""Upstream engines: Deltafin in front of vLLM, SGLang or llama-server (selected by conf/engine/*.yaml).

Each builder takes the composed config and returns an `EngineClient`; only the tokenizer is loaded here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from deltafin.config import DeltafinConfig
from deltafin.engine.upstream.engine import Adapter, UpstreamEngine, UpstreamSettings

if TYPE_CHECKING:  # the loader (and its torch import) waits until an engine is built
    from deltafin.engine.weights.tokenizer_only import TokenizerBundle


def settings_of(config: DeltafinConfig) -> UpstreamSettings:
    e = config.engine
    return UpstreamSettings(
        url=str(e.url),
        max_inflight=e.max_inflight,
        connect_timeout_s=e.connect_timeout_s,
        read_timeout_s=e.read_timeout_s,
        retry_after_s=e.retry_after_s,
        model=e.model,
        api_key=e.api_key,
        spare_connections=e.spare_connections,
    )


def _builder(
    name: str, make_adapter: Callable[[DeltafinConfig, TokenizerBundle], Adapter]
) -> Callable[..., UpstreamEngine]:
    def build(config: DeltafinConfig, **kwargs: Any) -> UpstreamEngine:
        from deltafin.engine.weights.tokenizer_only import load_tokenizer_only

        bundle = load_tokenizer_only(config.model)
        return UpstreamEngine(make_adapter(config, bundle), bundle, **kwargs)

    build.needs_url = True  # type: ignore[attr-defined]  # read by config validation
    build.engine_name = name  # type: ignore[attr-defined]  # for the log line, before the engine exists
    return build


def _vllm(config: DeltafinConfig, bundle: TokenizerBundle) -> Adapter:
    from deltafin.engine.upstream.vllm import VllmAdapter

    return VllmAdapter(settings_of(config), api=config.engine.api)


def _sglang(config: DeltafinConfig, bundle: TokenizerBundle) -> Adapter:
    from deltafin.engine.upstream.sglang import SglangAdapter

    return SglangAdapter(settings_of(config))


def _llama_server(config: DeltafinConfig, bundle: TokenizerBundle) -> Adapter:
    from deltafin.engine.upstream.llama_server import LlamaServerAdapter, added_tokens

    # the grammar names control tokens by id, so it needs the vocabulary the prompt ids come from
    return LlamaServerAdapter(settings_of(config), added_tokens(bundle.tokenizer, bundle.stop_token_ids))


build_vllm = _builder("vllm", _vllm)
build_sglang = _builder("sglang", _sglang)
build_llama_server = _builder("llama_server", _llama_server)

__all__ = ["UpstreamEngine", "UpstreamSettings", "build_llama_server", "build_sglang", "build_vllm"]
