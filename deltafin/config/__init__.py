"""Typed configuration: the schema, Hydra composition into it, and the checks after."""

from deltafin.config.compose import compose_config, compose_raw, conf_dir
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
    SpeculativeConfig,
)
from deltafin.config.validate import ConfigError, plain_config, validate_config

#: Where conf/ is found (a checkout's top-level folder, or the copy inside an installed wheel).
CONF_DIR = conf_dir()

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
    "SpeculativeConfig",
    "compose_config",
    "compose_raw",
    "conf_dir",
    "plain_config",
    "validate_config",
]
