"""Response objects: the request's settings echoed, the output items a chat answer becomes, usage.

One assistant message of the chat path becomes, in order: a `reasoning` item (its reasoning_content), a `message`
item (its content, as one `output_text` part) and a `function_call` item per tool call; a generation cut by the
token budget is `status: "incomplete"` with `incomplete_details.reason: "max_output_tokens"`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from deltafin.protocol.responses import ResponsesRequest
from deltafin.protocol.sampling import NO_DEFAULTS, SamplingDefaults
from deltafin.serving.encoded_reasoning import encode_reasoning
from deltafin.serving.responses.items import Item, item_id
from deltafin.serving.responses.tools import ServedTools


def new_response_id() -> str:
    return f"resp_{os.urandom(16).hex()}"


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def chat_usage_to_response(chat_usage: dict[str, Any] | None, reasoning_tokens: int) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return usage(chat_usage["prompt_tokens"], chat_usage["completion_tokens"], cached, reasoning_tokens)


@dataclass
class ResponseShape:
    """What every Response object of one request carries besides its output: the request echoed."""

    request: ResponsesRequest
    tools: ServedTools
    model: str
    id: str = field(default_factory=new_response_id)
    created_at: int = field(default_factory=lambda: int(time.time()))
    #: the model's default sampling: the echoed temperature and top_p are what the response was sampled with
    defaults: SamplingDefaults = NO_DEFAULTS

    def reasoning_item(self, text: str, *, status: str = "completed") -> Item:
        item: Item = {
            "type": "reasoning",
            "id": item_id("reasoning"),
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "status": status,
        }
        if self.request.includes("reasoning.encrypted_content"):
            item["encrypted_content"] = encode_reasoning(text)
        return item

    def message_item(self, text: str, *, status: str = "completed", logprobs: list[Any] | None = None) -> Item:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        return {"type": "message", "id": item_id("message"), "role": "assistant", "status": status, "content": [part]}

    def call_item(self, call_id: str, prompt_name: str, arguments: str, *, status: str = "completed") -> Item:
        name, namespace = self.tools.reported(prompt_name)
        item: Item = {
            "type": "function_call",
            "id": item_id("function_call"),
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }
        if namespace is not None:
            item["namespace"] = namespace
        return item

    def body(
        self,
        status: str,
        output: list[Item],
        *,
        usage: dict[str, Any] | None = None,
        incomplete_reason: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        request = self.request
        reasoning = request.reasoning
        fmt = request.text.format if request.text is not None else None
        text_format: dict[str, Any] = {"type": "text"}
        if fmt is not None and fmt.type != "text":
            text_format = {"type": fmt.type}
            if fmt.type == "json_schema":
                text_format.update(name=fmt.name or "response", schema=fmt.schema, strict=bool(fmt.strict))
                if fmt.description is not None:
                    text_format["description"] = fmt.description
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": None,
            "metadata": request.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "prompt_cache_key": request.prompt_cache_key,
            "reasoning": {
                "effort": reasoning.effort if reasoning else None,
                "summary": (reasoning.summary or reasoning.generate_summary) if reasoning else None,
            },
            "safety_identifier": request.safety_identifier,
            "service_tier": "default",
            "store": request.stores,
            "temperature": _first(request.temperature, self.defaults.temperature, 1.0),
            "text": {"format": text_format, "verbosity": "medium"},
            "tool_choice": "auto" if request.tool_choice is None else request.tool_choice,
            "tools": list(request.tools or ()),
            "top_logprobs": request.top_logprobs or 0,
            "top_p": _first(request.top_p, self.defaults.top_p, 1.0),
            "truncation": request.truncation or "disabled",
            "usage": usage,
            "user": request.user,
        }

    def from_chat(self, completion: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
        """The whole Response for a (non-streamed) chat completion body."""
        choice = completion["choices"][0]
        message = choice["message"]
        incomplete = choice["finish_reason"] == "length"
        status = "incomplete" if incomplete else "completed"
        output: list[Item] = []
        if message.get("reasoning_content"):
            output.append(self.reasoning_item(message["reasoning_content"], status=status))
        calls = message.get("tool_calls") or []
        content = message.get("content")
        if content or not calls:
            logprobs = None
            if self.request.includes("message.output_text.logprobs"):
                logprobs = output_logprobs((choice.get("logprobs") or {}).get("content") or [])
            output.append(self.message_item(content or "", status=status, logprobs=logprobs))
        for call in calls:
            output.append(
                self.call_item(call["id"], call["function"]["name"], call["function"]["arguments"], status=status)
            )
        return self.body(
            status,
            output,
            usage=chat_usage_to_response(completion.get("usage"), reasoning_tokens),
            incomplete_reason="max_output_tokens" if incomplete else None,
        )


def output_logprobs(chat_logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat's logprob entries in the output_text part's shape (the same fields, `bytes` always a list)."""

    def entry(lp: dict[str, Any]) -> dict[str, Any]:
        return {"token": lp["token"], "logprob": lp["logprob"], "bytes": lp.get("bytes") or list(lp["token"].encode())}

    return [{**entry(lp), "top_logprobs": [entry(top) for top in lp.get("top_logprobs") or ()]} for lp in chat_logprobs]


def _first(*values: Any) -> Any:
    """The first value that is not None (an explicit 0 is a value)."""
    return next(value for value in values if value is not None)
