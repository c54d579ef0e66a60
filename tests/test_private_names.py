"""The private names of transformers, tokenizers and uvicorn that Deltafin uses, pinned: each exists in the
installed version with the shape Deltafin calls it with. A release that renames or reshapes one fails here, by
name, instead of somewhere in a request (pyproject.toml bounds each library to the versions tested)."""

from __future__ import annotations

import inspect

import pytest


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_transformers_chat_template_helpers():
    """deltafin/prompt/template.py renders templates through transformers' own compile and data helpers, so a
    prompt is the one transformers would render."""
    from transformers.utils import chat_template_utils as utils

    assert parameters(utils._compile_jinja_template)[:1] == ["chat_template"]
    assert callable(utils._compile_jinja_template("{{ messages }}").environment.parse)
    assert utils._plain_template_data({"a": [1, {"b": "c"}]}) == {"a": [1, {"b": "c"}]}
    conversation = [{"role": "assistant", "content": "x", "reasoning_content": "r"}]
    assert isinstance(utils._alias_reasoning_fields(conversation), list)
    pattern, _ = utils._get_control_token_patterns(("<|im_start|>",))
    assert pattern is not None


def test_transformers_grouped_linear():
    """deltafin/engine/experts/slots.py multiplies a layer's slots through the grouped kernel transformers' own
    MoE forward uses."""
    import torch
    from transformers.integrations.moe import _grouped_linear

    x = torch.randn(3, 4)
    weight = torch.randn(2, 5, 4)  # two experts, [out, in]
    offsets = torch.tensor([2, 3], dtype=torch.int32)  # rows 0-1 to expert 0, row 2 to expert 1
    out = _grouped_linear(x, weight, offsets)
    assert torch.allclose(out[:2], x[:2] @ weight[0].T, atol=1e-5)
    assert torch.allclose(out[2:], x[2:] @ weight[1].T, atol=1e-5)


def test_the_fast_tokenizer_backend(loaded_model):
    """deltafin/token_codec.py calls the Rust backend directly where transformers' own calls reduce to it."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    from deltafin.token_codec import direct_backend

    tokenizer = loaded_model.tokenizer
    for name in ("_encode_plus", "_decode"):
        assert callable(getattr(TokenizersBackend, name))
    assert callable(PreTrainedTokenizerBase.__call__)
    assert direct_backend(tokenizer) is tokenizer._tokenizer


@pytest.mark.parametrize(
    "name",
    ["on_message_begin", "on_header", "on_headers_complete", "on_body", "on_message_complete",
     "on_response_complete", "connection_made", "data_received", "connection_lost"],
)  # fmt: skip
def test_uvicorn_protocol_callbacks(name):
    """deltafin/app/connections.py subclasses uvicorn's httptools protocol and calls up into these."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert callable(getattr(HttpToolsProtocol, name))


def test_uvicorn_protocol_state():
    """The attributes deltafin/app/connections.py reads of uvicorn's protocol, set by its constructor."""
    import asyncio

    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    async def app(scope, receive, send):  # never called
        raise AssertionError

    config = uvicorn.Config(app)
    config.load()
    loop = asyncio.new_event_loop()
    try:
        protocol = HttpToolsProtocol(config, ServerState(), app_state={}, _loop=loop)
        for name in ("transport", "cycle", "loop", "connections"):
            assert hasattr(protocol, name), name
        protocol.on_message_begin()  # a request's head starts: the fields its callbacks fill
        assert (protocol.url, protocol.headers) == (b"", [])
    finally:
        loop.close()


def test_uvicorn_server_internals():
    """deltafin/app/server.py's GracefulServer: uvicorn names the address it serves from `_log_started_message`
    and re-raises the signals it captured (`_captured_signals`) after it stops."""
    import uvicorn

    async def app(scope, receive, send):  # never called
        raise AssertionError

    server = uvicorn.Server(uvicorn.Config(app))
    assert parameters(server._log_started_message) == ["listeners"]
    assert isinstance(server._captured_signals, list)
    for name in ("startup", "handle_exit", "should_exit"):
        assert hasattr(server, name)
