"""The typed schema every composed config is validated against (keys documented in conf/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from deltafin.families import FAMILIES

#: Model families Deltafin knows (the registry in deltafin/families/); `model.family` and a rule's
#: `families` must name one of these. `generic` is any chat model served with plain OpenAI semantics.
KNOWN_FAMILIES = frozenset(FAMILIES)


@dataclass
class ModelConfig:
    name: str = MISSING
    family: str = MISSING
    path: str = MISSING
    aliases: list[str] = field(default_factory=list)
    variant: Optional[str] = None  # a variant of the family (GLM: glm45 | glm47); null = the family's default
    # Parser names as vLLM / SGLang deployments spell them (`model.tool_parser=glm47`): accepted for
    # familiarity, they only select the family's variant; the family owns its parsers.
    tool_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None
    context_length: Optional[int] = None
    chat_format: str = "template"
    content_format: str = "string"
    thinking_kwarg: Optional[str] = None
    trust_remote_code: bool = False
    dtype: str = "auto"
    cache_dir: Optional[str] = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExpertsConfig:
    """The expert pool (deltafin/engine/experts): routed experts of a MoE read from the checkpoint on demand."""

    pool_mb: int = 0  # MiB of expert slots; 0 = every expert resident (loaded whole, no pool)
    policy: str = "lru"  # which expert leaves a full pool: lru | lfru (frequency-weighted recency)
    prefetch: bool = True  # read the next layer's predicted experts while this layer computes
    readers: int = 4  # threads reading experts from the checkpoint (parallel reads keep a fast disk busy)


@dataclass
class PlacementConfig:
    device: str = "cpu"
    dtype: str = "float32"
    device_map: Optional[str] = None
    max_memory: Optional[dict[str, str]] = None
    offload_folder: Optional[str] = None
    num_threads: Optional[int] = None
    compile: bool = False
    quantize: str = "none"
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)


@dataclass
class CompatConfig:
    # Keyed by rule name so `~compat.rules.NAME` and `compat.rules.NAME.value=...` work on the command line.
    rules: dict[str, Any] = field(default_factory=dict)


@dataclass
class QueueConfig:
    max_waiting: int = 16
    timeout_s: float = 30.0
    large_body_bytes: int = 65536
    inline_body_bytes: int = 8192
    max_large_prompts: int = 2


@dataclass
class MemoConfig:
    entries: int = 32


@dataclass
class PrefixCacheConfig:
    enabled: bool = True
    min_tokens: int = 16


@dataclass
class TemplateConfig:
    trust_request_chat_template: bool = False
    render_timeout_s: float = 2.0
    max_rendered_chars: int = 8 * 1024 * 1024


@dataclass
class ConnectionsConfig:
    max_open: int = 256
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)
    max_body_bytes: int = 4 * 1024 * 1024
    completion_default_max_tokens: int = 256
    max_n: int = 8
    max_stop_sequences: int = 16
    max_top_logprobs: int = 20
    log_level: str = "info"
    queue: QueueConfig = field(default_factory=QueueConfig)
    memo: MemoConfig = field(default_factory=MemoConfig)
    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    open_routes: list[str] = field(default_factory=lambda: ["/health", "/metrics", "/schema"])
    shutdown_grace_s: float = 10.0
    templates: TemplateConfig = field(default_factory=TemplateConfig)
    connections: ConnectionsConfig = field(default_factory=ConnectionsConfig)


@dataclass
class EngineConfig:
    """One schema for every engine; each conf/engine/*.yaml sets the keys its engine reads (documented there)."""

    # A callable `(config) -> EngineClient`; an upstream's builder also needs `url`.
    _target_: str = "deltafin.app.services.build_local_engine"
    # local engine
    max_batch: int = 8
    # upstream engines
    url: Optional[str] = None
    api: str = "auto"
    model: Optional[str] = None
    api_key: Optional[str] = None
    max_inflight: int = 64
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    retry_after_s: int = 2
    spare_connections: int = 1


@dataclass
class DeltafinConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    compat: CompatConfig = field(default_factory=CompatConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
