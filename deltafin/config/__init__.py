"""Typed configuration: the schema and its validation after Hydra composes the YAML."""

from deltafin.config.schema import (
    CompatConfig,
    DeltafinConfig,
    EngineConfig,
    ExpertsConfig,
    MemoConfig,
    ModelConfig,
    PlacementConfig,
    QueueConfig,
    ServerConfig,
)
from deltafin.config.validate import ConfigError, CONF_DIR, plain_config, validate_config

__all__ = [
    "CONF_DIR",
    "CompatConfig",
    "ConfigError",
    "DeltafinConfig",
    "EngineConfig",
    "ExpertsConfig",
    "MemoConfig",
    "ModelConfig",
    "PlacementConfig",
    "QueueConfig",
    "ServerConfig",
    "plain_config",
    "validate_config",
]
