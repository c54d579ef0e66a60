"""The family registry: one registered unit per family, and the one place every config name comes from."""

import pytest

from deltafin.config import CONF_DIR, ConfigError
from deltafin.families import (
    FAMILIES,
    KNOWN_FAMILIES,
    ModelFamily,
    build_output_parser,
    check_family,
    get_family,
    register,
)
from deltafin.markup import PlainOutputParser
from tests.conftest import compose_config

MODEL_CONFIGS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def test_known_families_are_the_registry():
    assert set(FAMILIES) == KNOWN_FAMILIES
    assert {"generic", "smollm2", "kimi_k2", "kimi_k3", "glm", "qwen3"} <= KNOWN_FAMILIES  # names rules use


@pytest.mark.parametrize("model", MODEL_CONFIGS)
def test_every_model_config_names_a_registered_family_its_chat_format_and_a_valid_variant(model):
    config = compose_config([f"model={model}", "model.path=/models/x"]).model
    family = get_family(config.family)
    assert config.chat_format == family.chat_format
    check_family(config.family, config.variant)


class TestVariants:
    def test_default_is_the_first(self):
        assert get_family("glm").variant(None) == "glm45" and get_family("kimi_k3").variant(None) is None

    def test_unknown_variant_is_a_one_line_config_error(self):
        with pytest.raises(ConfigError, match=r"^model\.variant: 'glm46' is not a variant of family 'glm'"):
            check_family("glm", "glm46")

    def test_a_family_without_variants_refuses_one(self):
        with pytest.raises(ConfigError, match="model.variant"):
            check_family("kimi_k2", "glm47")

    def test_the_variant_picks_the_parser(self):
        text = "<tool_call>now\n</tool_call>"
        for variant in ("glm45", "glm47"):
            parser = build_output_parser(
                "glm",
                variant,
                prompt_text="</think>",
                tool_schemas=[{"type": "function", "function": {"name": "now"}}],
                new_id=lambda i, n: "x",
            )
            calls = parser.feed(text).tool_calls + parser.finish("stop").tool_calls
            assert [c.name for c in calls if c.name] == ["now"]


class TestRegistry:
    def test_unknown_family(self):
        with pytest.raises(ValueError, match="'nope' is not a known family"):
            build_output_parser("nope")

    def test_a_name_is_registered_once(self):
        class Again(ModelFamily):
            name = "glm"

        with pytest.raises(ValueError, match="registered twice"):
            register(Again)

    def test_plain_families_parse_nothing(self):
        assert isinstance(
            build_output_parser("smollm2", tool_schemas=[{"type": "function", "function": {"name": "f"}}]),
            PlainOutputParser,
        )

    def test_kimi_ids_come_from_the_family(self):
        tools = [{"type": "function", "function": {"name": "now"}}]
        glm = build_output_parser("glm", "glm47", prompt_text="</think>", tool_schemas=tools, history_calls=3)
        k3 = build_output_parser("kimi_k3", prompt_text="<|open|>response<|sep|>", tool_schemas=tools, history_calls=3)
        k3_call = '<|open|>tools<|sep|><|open|>call tool="now" index="1"<|sep|><|close|>call<|sep|>'
        assert glm.feed("<tool_call>now</tool_call>").tool_calls[0].id.startswith("call_")
        assert k3.feed(k3_call).tool_calls[0].id == "functions.now:3"

    @pytest.mark.parametrize("name", sorted(FAMILIES))
    def test_grammar_hook_forces_calls_exactly_where_the_family_parses_them(self, name):
        family = FAMILIES[name]
        variant = family.variant(None)
        tools = [{"type": "function", "function": {"name": "now"}}]
        assert family.tool_call_structure(variant, tools, "auto", prompt_text="") is None
        forced = family.tool_call_structure(variant, tools, "required", prompt_text="")
        assert (forced is not None) == family.parses_tool_calls(variant)
