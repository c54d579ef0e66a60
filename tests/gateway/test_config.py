"""Every conf/engine option composes and validates; an upstream without a URL is a one-line config error."""

from __future__ import annotations

import pytest
from hydra.utils import get_method

from deltafin.config import ConfigError
from tests.conftest import compose_config


@pytest.mark.parametrize("engine", ["local", "vllm", "sglang", "llama_server"])
def test_each_engine_composes_and_its_builder_imports(engine):
    overrides = [f"engine={engine}"] + ([] if engine == "local" else ["engine.url=http://127.0.0.1:9"])
    config = compose_config(overrides)
    builder = get_method(config.engine._target_)
    assert builder.engine_name == engine


def test_local_is_the_default():
    assert compose_config().engine._target_.endswith("build_local_engine")


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["engine=vllm"], "engine.url"),
        (["engine=vllm", "engine.url=gpu-node:8000"], "engine.url"),
        (["engine=vllm", "engine.url=http://x", "engine.api=grpc"], "engine.api"),
        (["engine=sglang", "engine.url=http://x", "engine.max_inflight=0"], "engine.max_inflight"),
        (["engine._target_=no.such.builder"], "engine._target_"),
    ],
)
def test_bad_engine_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose_config(overrides)
