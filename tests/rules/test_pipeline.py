"""Building the pipeline from config, family scoping, hook order, change tracking."""

import asyncio

import pytest

from deltafin.config import ConfigError
from deltafin.errors import DeltafinError, InvalidRequestError
from deltafin.rules import Rule, RuleContext, build_pipeline
from tests.conftest import compose_config
from tests.rules.test_rules import chat

CTX = RuleContext(family="glm", endpoint="chat", context_length=8192)


class Recorder(Rule):
    """Test rule: appends its tag to a shared log in every hook and changes what it sees."""

    log: list = []

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def request(self, request, ctx):
        Recorder.log.append(("request", self.tag))
        return request.__copy__()

    def response(self, body, ctx):
        Recorder.log.append(("response", self.tag))
        return {**body, "seen": body.get("seen", "") + self.tag}

    def error(self, error, ctx):
        Recorder.log.append(("error", self.tag))
        return InvalidRequestError(error.message + self.tag)


RECORDER = "tests.rules.test_pipeline.Recorder"


class TestBuild:
    def test_para_builds_every_rule_for_its_family(self):
        rules = compose_config(["compat=para"]).compat.rules
        assert build_pipeline(rules, "glm").names == [
            "chat_default_max_tokens",
            "max_tokens_cap",
            "force_tool_choice_auto",
            "tool_choice_required_to_auto",
            "glm_context_413",
            "glm_reasoning_usage",
            "flatten_tool_text",
            "streaming_error_preflight",
        ]
        kimi = build_pipeline(rules, "kimi_k3").names
        assert "kimi_thinking" in kimi and "kimi_sampling_pins" in kimi and "glm_context_413" not in kimi

    def test_none_builds_nothing(self):
        assert build_pipeline(compose_config().compat.rules, "smollm2").names == []

    @pytest.mark.parametrize(
        "rules,match",
        [
            ({"x": {"_target_": "nope.Nope"}}, r"^compat\.rules\.x: "),
            ({"x": {"value": 1}}, r"compat\.rules\.x: a rule needs `_target_`"),
            (
                {"x": {"_target_": "deltafin.rules.max_tokens_cap.MaxTokensCap", "value": -1}},
                r"compat\.rules\.x\.value: -1 ",
            ),
            (
                {"x": {"_target_": "deltafin.rules.max_tokens_cap.MaxTokensCap", "bogus": 1}},
                r"compat\.rules\.x\.bogus: MaxTokensCap takes no argument 'bogus' \(it takes: value\)",
            ),
            (
                {"x": {"_target_": "deltafin.rules.force_tool_choice_auto.ForceToolChoiceAuto", "families": ["glx"]}},
                r"compat\.rules\.x\.families: unknown family 'glx'",
            ),
            ({"x": {"_target_": "collections.OrderedDict"}}, r"is not a deltafin Rule"),
        ],
    )
    def test_bad_rules_fail_naming_the_rule(self, rules, match):
        with pytest.raises(ConfigError, match=match):
            build_pipeline(rules, "glm")

    def test_override_removes_and_tunes_rules(self):
        rules = compose_config(
            ["compat=para", "~compat.rules.kimi_sampling_pins", "compat.rules.chat_default_max_tokens.value=4096"]
        ).compat.rules
        pipeline = build_pipeline(rules, "kimi_k3")
        assert "kimi_sampling_pins" not in pipeline.names
        assert pipeline.rules[0].rule.value == 4096

    def test_user_rule_can_be_added_from_the_command_line(self):
        rules = compose_config(
            ["compat=none", f"+compat.rules.mine._target_={RECORDER}", "+compat.rules.mine.tag=m"]
        ).compat.rules
        assert build_pipeline(rules, "smollm2").names == ["mine"]


class TestArgumentValues:
    """Rule arguments are typed and ranged at start-up like every other key: a wrong value is one line naming
    it, never a rule that lifts every limit (nan) or a 500 on every request (a string where a number goes)."""

    @pytest.mark.parametrize(
        "override, key",
        [
            ("compat.rules.max_tokens_cap.value=nan", "compat.rules.max_tokens_cap.value"),
            ("compat.rules.max_tokens_cap.value=inf", "compat.rules.max_tokens_cap.value"),
            ("compat.rules.max_tokens_cap.value=2.5", "compat.rules.max_tokens_cap.value"),
            ("compat.rules.max_tokens_cap.value=true", "compat.rules.max_tokens_cap.value"),
            ("compat.rules.max_tokens_cap.value='64'", "compat.rules.max_tokens_cap.value"),
            ("compat.rules.chat_default_max_tokens.value=0", "compat.rules.chat_default_max_tokens.value"),
            ("compat.rules.kimi_sampling_pins.top_p=high", "compat.rules.kimi_sampling_pins.top_p"),
            ("compat.rules.kimi_sampling_pins.top_p=nan", "compat.rules.kimi_sampling_pins.top_p"),
            ("compat.rules.kimi_sampling_pins.top_p=0", "compat.rules.kimi_sampling_pins.top_p"),
            ("compat.rules.kimi_sampling_pins.n=0", "compat.rules.kimi_sampling_pins.n"),
            ("compat.rules.kimi_sampling_pins.n=1.0", "compat.rules.kimi_sampling_pins.n"),
            ("compat.rules.kimi_sampling_pins.presence_penalty=3", "compat.rules.kimi_sampling_pins.presence_penalty"),
            ("+compat.rules.kimi_sampling_pins.temperature=[1]", "compat.rules.kimi_sampling_pins.temperature"),
            ("compat.rules.glm_context_413.status='413'", "compat.rules.glm_context_413.status"),
            ("+compat.rules.kimi_thinking.kwarg=5", "compat.rules.kimi_thinking.kwarg"),
        ],
    )
    def test_a_wrong_value_is_a_config_error_naming_it(self, override, key):
        # the default model's family: a rule scoped to another family is still a key of this config
        with pytest.raises(ConfigError, match=rf"^{key}: "):
            compose_config(["compat=para", override])

    def test_values_of_the_right_type_pass(self):
        rules = compose_config(
            [
                "compat=para",
                "compat.rules.max_tokens_cap.value=64",
                "compat.rules.kimi_sampling_pins.top_p=1",  # an int where a float goes, as in a request
                "+compat.rules.kimi_sampling_pins.top_k=-1",
            ]
        ).compat.rules
        pipeline = build_pipeline(rules, "kimi_k3")
        pins = next(r.rule for r in pipeline.rules if r.name == "kimi_sampling_pins")
        assert pins.pins["top_p"] == 1 and pins.pins["top_k"] == -1
        assert next(r.rule for r in pipeline.rules if r.name == "max_tokens_cap").value == 64


class TestOrder:
    def pipeline(self):
        return build_pipeline({"a": {"_target_": RECORDER, "tag": "a"}, "b": {"_target_": RECORDER, "tag": "b"}}, "glm")

    def test_request_in_config_order_response_and_error_reversed(self):
        Recorder.log = []
        pipeline, changed = self.pipeline(), []
        pipeline.on_request(chat(), CTX, changed)
        body = pipeline.on_response({}, CTX, changed)
        error = pipeline.on_error(DeltafinError("x"), CTX, changed)
        assert Recorder.log == [
            ("request", "a"),
            ("request", "b"),
            ("response", "b"),
            ("response", "a"),
            ("error", "b"),
            ("error", "a"),
        ]
        assert body["seen"] == "ba" and error.message == "xba"
        assert changed == ["a", "b"]

    def test_the_clients_request_object_is_never_touched(self):
        request = chat()
        out = build_pipeline({"f": {"_target_": "deltafin.rules.kimi_thinking.KimiThinking"}}, "glm").on_request(
            chat(thinking={"type": "enabled"}), CTX, []
        )
        assert out.chat_template_kwargs == {"thinking": True} and request.chat_template_kwargs is None

    def test_rules_that_do_not_act_are_not_listed(self):
        changed = []
        pipeline = build_pipeline(compose_config(["compat=para"]).compat.rules, "glm")
        pipeline.on_request(chat(max_tokens=5, tool_choice="auto"), CTX, changed)
        assert changed == []

    def test_default_max_tokens_in_config_order(self):
        """chat_default_max_tokens gives its value, the cap after it lowers it; each is listed as it acts."""
        rules = {
            "default": {"_target_": "deltafin.rules.chat_default_max_tokens.ChatDefaultMaxTokens", "value": 500},
            "cap": {"_target_": "deltafin.rules.max_tokens_cap.MaxTokensCap", "value": 100},
        }
        changed: list[str] = []
        assert build_pipeline(rules, "glm").default_max_tokens(chat(), CTX, changed) == 100
        assert changed == ["default", "cap"]
        changed = []
        rules["cap"]["value"] = 1000
        assert build_pipeline(rules, "glm").default_max_tokens(chat(), CTX, changed) == 500
        assert changed == ["default"]

    def test_stream_hooks_wrap_in_reverse(self):
        class Tag(Rule):
            def __init__(self, tag):
                self.tag = tag

            def stream(self, chunks, ctx):
                async def wrap():
                    async for c in chunks:
                        yield c + self.tag

                return wrap()

        async def source():
            yield ""

        from deltafin.rules.pipeline import NamedRule, RulePipeline

        pipeline = RulePipeline([NamedRule("a", Tag("a")), NamedRule("b", Tag("b"))])
        changed = []

        async def run():
            return [c async for c in pipeline.on_stream(source(), CTX, changed)]

        # b wraps the source first, a wraps b: the first-listed rule sees chunks last.
        assert asyncio.run(run()) == ["ba"] and changed == ["b", "a"]
