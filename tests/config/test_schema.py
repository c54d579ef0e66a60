"""The schema itself: closed choices agree with the registries that serve them, every check refuses what is
just outside its range, and an operator's own config folder composes."""

from __future__ import annotations

import dataclasses
import logging
import typing

import pytest
from omegaconf import OmegaConf

from deltafin.config import ConfigError, DeltafinConfig, plain_config, validate_config
from deltafin.config.schema import ChatFormatName, Dtype, LogLevel, ModelDtype, Quantize, Range
from deltafin.config.validate import check_fields
from tests.conftest import compose_config


def ranged_keys(cls: type = DeltafinConfig, prefix: str = "") -> list[tuple[str, Range]]:
    found = []
    hints = typing.get_type_hints(cls)
    for spec in dataclasses.fields(cls):
        if isinstance(spec.metadata.get("check"), Range):
            found.append((prefix + spec.name, spec.metadata["check"]))
        if dataclasses.is_dataclass(hints[spec.name]):
            found.extend(ranged_keys(hints[spec.name], f"{prefix}{spec.name}."))
    return found


def field_type(key: str) -> object:
    """The annotation of a dotted key's field (int, Optional[int], float ...)."""
    node: type = DeltafinConfig
    *groups, name = key.split(".")
    for group in groups:
        node = typing.get_type_hints(node)[group]
    return typing.get_type_hints(node)[name]


#: keys checked against another key, and the partner's value that lets each of their own bounds pass
#: (ngram_min may not be above ngram_max)
PARTNERS = {
    "engine.speculative.ngram_min": ("engine.speculative.ngram_max", 64),
    "engine.speculative.ngram_max": ("engine.speculative.ngram_min", 1),
}


def validate_with(key: str, value) -> DeltafinConfig:
    cfg = OmegaConf.structured(DeltafinConfig)
    cfg.model.merge_with({"name": "m", "family": "generic", "path": "/m"})
    if key in PARTNERS:
        OmegaConf.update(cfg, *PARTNERS[key])
    OmegaConf.update(cfg, key, value)
    return validate_config(cfg)


class TestChoices:
    def test_chat_formats_are_the_prompt_registry(self):
        from deltafin.prompt.chat_format import CHAT_FORMATS

        assert set(ChatFormatName) == set(CHAT_FORMATS)

    def test_quantize_modes_are_the_engine_modes(self):
        from deltafin.engine.quant.quantize import MODES

        assert set(Quantize) == set(MODES)

    def test_dtypes_are_the_loader_dtypes(self):
        from deltafin.engine.weights.loader import _DTYPES

        assert set(Dtype) == set(_DTYPES) and set(ModelDtype) == {"auto", *_DTYPES}

    def test_log_levels_are_logging_levels(self):
        assert all(isinstance(getattr(logging, level.upper()), int) for level in LogLevel)

    def test_plain_values_compare_as_strings(self):
        config = plain_config(compose_config(["placement=cuda"]))
        assert config.placement.device == "cuda" and f"{config.placement.dtype}" == "bfloat16"


class TestRanges:
    def test_every_default_passes_its_own_check(self):
        check_fields(DeltafinConfig())

    @pytest.mark.parametrize("key, bounds", ranged_keys(), ids=lambda x: x if isinstance(x, str) else "")
    def test_the_bounds_pass_and_just_outside_fails(self, key, bounds):
        integral = field_type(key) in (int, int | None)
        step = 1 if integral else 0.001
        for inside in (bounds.low, bounds.high):
            validate_with(key, int(inside) if integral else inside)
        for outside in (bounds.low - step, bounds.high + step):
            with pytest.raises(ConfigError, match=rf"^{key.replace('.', r'[.]')}: "):
                validate_with(key, int(outside) if integral else outside)
        if bounds.nullable:
            assert OmegaConf.select(validate_with(key, None), key) is None


class TestOperatorConfigs:
    def test_a_search_path_adds_an_operator_option(self, tmp_path):
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "mine.yaml").write_text("name: mine\nfamily: generic\npath: /models/mine\n")
        config = compose_config([f"hydra.searchpath=[file://{tmp_path}]", "model=mine"])
        assert (config.model.name, config.model.chat_format, config.server.port) == ("mine", "template", 8000)

    def test_an_unknown_key_in_an_operator_option_names_it(self, tmp_path):
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "mine.yaml").write_text("name: mine\nfamily: generic\npath: /m\ncontext: 4096\n")
        with pytest.raises(ConfigError, match=r"^model\.context: "):
            compose_config([f"hydra.searchpath=[file://{tmp_path}]", "model=mine"])


def test_max_memory_takes_a_mapping_from_the_command_line():
    """A dict override into a key whose default is null (OmegaConf cannot merge one into a null Optional[dict]:
    that was a traceback), GPU indices kept as ints for accelerate."""
    from deltafin.cli import checked_config

    config = checked_config(["placement=auto", "placement.max_memory={0:20GiB,cpu:64GiB}"])
    assert dict(config.placement.max_memory) == {0: "20GiB", "cpu": "64GiB"}
    with pytest.raises(ConfigError, match=r"placement.max_memory: 'gpu' is not a device"):
        checked_config(["placement.max_memory={gpu:1GiB}"])
