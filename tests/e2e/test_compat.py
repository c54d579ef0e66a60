"""compat=para against compat=none through a real server (the shared local one, tests/shared_server.py) and
the openai client.

Family-scoped rules run on the tiny GLM-4.7 and Kimi K3 models (random weights, 4096-token context), entries of
the shared server served as `glm-para` and `kimi-para`; compat=none runs on its main model, the embedded default.
"""

from pathlib import Path

import httpx
import openai
import pytest

from deltafin.tiny import write_tiny_model
from tests.conftest import TINY_OVERRIDES, TINY_SPECS
from tests.shared_server import shared_model

pytestmark = pytest.mark.e2e

LONG = "word " * 9000


def tiny_entry(name: str, overrides: list[str]):
    """An entry serving the untaught tiny model `name` with `overrides`."""

    def prepare(root: Path) -> tuple[Path, list[str]]:
        family, variant = TINY_SPECS[name]
        path = write_tiny_model(family, root / "model", variant=variant)
        return path, [*TINY_OVERRIDES[name], f"model.path={path}", *overrides]

    return prepare


# Without force_tool_choice_auto, so the GLM rule for "required" is the one that acts; with the cap on.
GLM_PARA = shared_model(
    "glm-para",
    tiny_entry(
        "glm47",
        [
            "compat=para",
            "compat.rules.chat_default_max_tokens.value=5",
            "compat.rules.max_tokens_cap.value=6",
            "~compat.rules.force_tool_choice_auto",
        ],
    ),
)
KIMI_PARA = shared_model("kimi-para", tiny_entry("kimi_k3", ["compat=para"]))


@pytest.fixture(scope="module")
def glm_para(local_server):
    """The server that serves GLM_PARA (requests name it)."""
    return local_server


@pytest.fixture(scope="module")
def kimi_para(local_server):
    """The server that serves KIMI_PARA (requests name it)."""
    return local_server


MODEL = None  # no `model`: the main model (compat=none)


def client_for(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)


def user(text="Say hello."):
    return [{"role": "user", "content": text}]


def rules_header(response) -> list[str]:
    value = response.headers.get("x-deltafin-rules", "")
    return [name for name in value.split(",") if name]


class TestContextOverflow:
    def test_none_answers_400(self, live_server):
        with pytest.raises(openai.BadRequestError):
            client_for(live_server).chat.completions.create(model=MODEL, messages=user(LONG))

    def test_glm_para_answers_413(self, glm_para):
        with pytest.raises(openai.APIStatusError) as info:
            client_for(glm_para).chat.completions.create(model=GLM_PARA.name, messages=user(LONG))
        assert info.value.status_code == 413
        assert info.value.body["type"] == "PayloadTooLargeError"
        assert "maximum context length is 4096 tokens" in info.value.message
        assert "glm_context_413" in rules_header(info.value.response)

    def test_glm_para_answers_413_when_streaming(self, glm_para):
        with pytest.raises(openai.APIStatusError) as info:
            client_for(glm_para).chat.completions.create(model=GLM_PARA.name, messages=user(LONG), stream=True)
        assert info.value.status_code == 413

    def test_kimi_para_keeps_400(self, kimi_para):
        with pytest.raises(openai.BadRequestError):
            client_for(kimi_para).chat.completions.create(model=KIMI_PARA.name, messages=user(LONG))


class TestDefaultMaxTokens:
    def test_para_default_applies_without_max_tokens(self, glm_para):
        raw = client_for(glm_para).chat.completions.with_raw_response.create(
            model=GLM_PARA.name, messages=user("Write a long story."), temperature=0, extra_body={"ignore_eos": True}
        )
        response = raw.parse()
        assert response.usage.completion_tokens == 5 and response.choices[0].finish_reason == "length"
        assert "chat_default_max_tokens" in rules_header(raw)

    def test_explicit_max_tokens_is_untouched(self, glm_para):
        raw = client_for(glm_para).chat.completions.with_raw_response.create(
            model=GLM_PARA.name,
            messages=user("Write a long story."),
            temperature=0,
            max_tokens=3,
            extra_body={"ignore_eos": True},
        )
        rules = rules_header(raw)
        assert raw.parse().usage.completion_tokens == 3
        assert "chat_default_max_tokens" not in rules and "max_tokens_cap" not in rules


class TestMaxTokensCap:
    def test_chat_over_the_cap_is_lowered(self, glm_para):
        raw = client_for(glm_para).chat.completions.with_raw_response.create(
            model=GLM_PARA.name, messages=user(), max_tokens=50, temperature=0, extra_body={"ignore_eos": True}
        )
        assert raw.parse().usage.completion_tokens == 6 and "max_tokens_cap" in rules_header(raw)

    def test_completion_default_is_bounded(self, glm_para):
        raw = client_for(glm_para).completions.with_raw_response.create(
            model=GLM_PARA.name, prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True}
        )
        assert raw.parse().usage.completion_tokens == 6 and rules_header(raw) == ["max_tokens_cap"]

    def test_none_has_no_cap(self, live_server):
        response = client_for(live_server).chat.completions.create(
            model=MODEL, messages=user(), max_tokens=9, temperature=0, extra_body={"ignore_eos": True}
        )
        assert response.usage.completion_tokens == 9

    def test_none_has_no_rules_header(self, live_server):
        raw = client_for(live_server).chat.completions.with_raw_response.create(
            model=MODEL, messages=user(), max_tokens=2
        )
        assert "x-deltafin-rules" not in raw.headers


class TestToolChoice:
    TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]

    def test_glm_required_is_served_as_auto(self, glm_para):
        raw = client_for(glm_para).chat.completions.with_raw_response.create(
            model=GLM_PARA.name, messages=user(), tools=self.TOOLS, tool_choice="required", max_tokens=2
        )
        assert "tool_choice_required_to_auto" in rules_header(raw)

    def test_glm_none_stays_none(self, glm_para):
        raw = client_for(glm_para).chat.completions.with_raw_response.create(
            model=GLM_PARA.name, messages=user(), tools=self.TOOLS, tool_choice="none", max_tokens=2
        )
        assert "tool_choice_required_to_auto" not in rules_header(raw)

    @pytest.mark.parametrize("choice", ["required", "none", {"type": "function", "function": {"name": "get_time"}}])
    def test_force_auto_serves_any_explicit_choice_as_auto(self, kimi_para, choice):
        raw = client_for(kimi_para).chat.completions.with_raw_response.create(
            model=KIMI_PARA.name, messages=user(), tools=self.TOOLS, tool_choice=choice, max_tokens=2
        )
        assert "force_tool_choice_auto" in rules_header(raw)

    def test_auto_is_left_alone(self, kimi_para):
        raw = client_for(kimi_para).chat.completions.with_raw_response.create(
            model=KIMI_PARA.name, messages=user(), tools=self.TOOLS, tool_choice="auto", max_tokens=2
        )
        assert "force_tool_choice_auto" not in rules_header(raw)


class TestReasoningUsage:
    """GLM-4.7 prefills <think>: a short greedy answer cut by max_tokens is all reasoning."""

    def test_glm_usage_has_reasoning_tokens(self, glm_para):
        response = client_for(glm_para).chat.completions.create(
            model=GLM_PARA.name, messages=user(), max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        details = response.usage.completion_tokens_details
        assert response.choices[0].message.reasoning_content
        assert 0 < details.reasoning_tokens <= response.usage.completion_tokens

    def test_glm_stream_usage_has_reasoning_tokens(self, glm_para):
        chunks = list(
            client_for(glm_para).chat.completions.create(
                model=GLM_PARA.name,
                messages=user(),
                max_tokens=6,
                temperature=0,
                stream=True,
                seed=3,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        assert chunks[-1].usage.completion_tokens_details.reasoning_tokens > 0

    def test_none_usage_has_no_details(self, live_server):
        response = client_for(live_server).chat.completions.create(model=MODEL, messages=user(), max_tokens=3)
        assert response.usage.completion_tokens_details is None


class TestSamplingPins:
    def test_kimi_para_serves_one_choice(self, kimi_para):
        raw = client_for(kimi_para).chat.completions.with_raw_response.create(
            model=KIMI_PARA.name, messages=user(), n=3, max_tokens=2, top_p=0.5
        )
        assert len(raw.parse().choices) == 1 and "kimi_sampling_pins" in rules_header(raw)

    def test_glm_para_leaves_sampling_alone(self, glm_para):
        response = client_for(glm_para).chat.completions.create(model=GLM_PARA.name, messages=user(), n=3, max_tokens=2)
        assert len(response.choices) == 3


class TestKimiThinking:
    def test_thinking_field_is_mapped(self, kimi_para):
        raw = client_for(kimi_para).chat.completions.with_raw_response.create(
            model=KIMI_PARA.name, messages=user(), max_tokens=2, extra_body={"thinking": {"type": "disabled"}}
        )
        assert "kimi_thinking" in rules_header(raw)

    @pytest.mark.parametrize("kind,channel", [("disabled", "response"), ("enabled", "think")])
    def test_the_prompt_opens_the_matching_channel(self, kimi_para, kind, channel):
        base = kimi_para.base_url
        tokens = httpx.post(
            f"{base}/tokenize", json={"model": KIMI_PARA.name, "messages": user(), "thinking": {"type": kind}}
        ).json()["tokens"]
        prompt = httpx.post(f"{base}/detokenize", json={"model": KIMI_PARA.name, "tokens": tokens}).json()["prompt"]
        assert prompt.endswith(f'<|open|>message role="assistant"<|sep|><|open|>{channel}<|sep|>')


class TestFlattenToolText:
    MESSAGES = [
        {"role": "user", "content": "time?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}],
        },
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [{"type": "text", "text": "12:"}, {"type": "text", "text": "00"}],
        },
    ]

    def tokens(self, server, messages, model=MODEL):
        body = {"messages": messages, **({"model": model} if model else {})}
        response = httpx.post(f"{server.base_url}/tokenize", json=body)
        return response.json()["tokens"], rules_header(response)

    def with_tool_content(self, content):
        return self.MESSAGES[:2] + [{**self.MESSAGES[2], "content": content}]

    def test_para_joins_tool_text_parts_with_nothing(self, glm_para):
        tokens, rules = self.tokens(glm_para, self.MESSAGES, GLM_PARA.name)
        assert tokens == self.tokens(glm_para, self.with_tool_content("12:00"), GLM_PARA.name)[0]
        assert "flatten_tool_text" in rules

    def test_none_passes_the_parts_to_the_template(self, live_server):
        tokens, _ = self.tokens(live_server, self.MESSAGES)
        # smollm2 reads string content, so Deltafin joins parts with "\n" for it
        assert tokens == self.tokens(live_server, self.with_tool_content("12:\n00"))[0]
        assert tokens != self.tokens(live_server, self.with_tool_content("12:00"))[0]


class TestImageUrl:
    @pytest.mark.parametrize("image_url", ["http://x/cat.png", {"url": "http://x/cat.png"}])
    def test_bare_string_and_object_get_the_same_400(self, live_server, image_url):
        content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": image_url}]
        with pytest.raises(openai.BadRequestError) as info:
            client_for(live_server).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": content}]
            )
        assert "accepts text only" in info.value.message and info.value.body["param"] == "messages[0].content[1]"
