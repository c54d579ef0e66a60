"""Property-based fuzzing of every JSON endpoint, driven by the published /schema/openapi.json: whatever a
client sends, the answer is never >= 500, and every error is OpenAI-shaped (Anthropic-shaped on the Messages
routes).

Bodies start from a small valid request per route and get fields of the route's schema (plus unknown ones)
replaced by arbitrary JSON, so both the decoder and the code past it (rules, templates, sampling) are hit.
Generation is kept to a token or two so the cases take well under a minute on an idle machine.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

BASES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 1},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2]},
    "/parse": {"text": "Hi"},
    "/v1/messages": {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    "/v1/messages/count_tokens": {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]},
}
#: Fields whose large (valid) values would only make a case slow, not more interesting.
COSTLY = {"max_tokens": 2, "max_completion_tokens": 2, "n": 2, "top_logprobs": 2, "logprobs": 2}

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
    | st.sampled_from(["", "user", "auto", "none", "required", "function", "text", "\x00", "<|im_start|>", "1"])
)
#: Object keys: random, or names the request types use at some depth (messages, tools, template kwargs).
KEYS = st.text(max_size=12) | st.sampled_from(["chat_template", "role", "content", "type", "function", "name", "text"])
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def fields(client):
    """Per route, the property names its request schema publishes."""
    schema = client.get("/schema/openapi.json").json()
    out = {}
    for path in BASES:
        ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        component = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
        out[path] = sorted(component["properties"])
    return out


def bounded(path, body):
    if path.endswith("completions") and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 1  # else chat runs to EOS
    for name, cap in COSTLY.items():
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and cap < value < 100_000:
            body[name] = cap
    return body


@settings(max_examples=160, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_no_request_body_gets_a_server_error(client, fields, data):
    path = data.draw(st.sampled_from(sorted(BASES)))
    names = st.sampled_from(fields[path]) | st.text(max_size=12)
    if data.draw(st.integers(0, 9)) == 0:
        body = data.draw(JSON)  # not even an object, sometimes
    else:
        body = bounded(path, {**BASES[path], **data.draw(st.dictionaries(names, JSON, max_size=4))})
    response = client.post(path, json=body)
    assert response.status_code < 500, (path, body, response.text)
    if response.status_code >= 400 and path.startswith("/v1/messages"):
        answer = response.json()
        assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}, response.text
    elif response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, response.text
