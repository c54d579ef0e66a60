"""/v1/responses on top of the chat path.

A Responses request becomes a chat request (deltafin.serving.responses.conversation, .tools) and is served by
ChatService itself: the rules (compat=para included), the family's chat format and parsers, constrained decoding,
the memo, admission, logs and metrics are chat's, on every engine. Its answer (a chat body, or chat chunks) is
reshaped into a Response object or the Responses event stream (.output, .events), and kept when `store` is on
(.store). previous_response_id continues a stored conversation; `truncation: "auto"` drops the oldest turns until
the prompt fits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import structlog

from deltafin.errors import DeltafinError, EngineUnavailableError, InvalidRequestError, NotFoundError
from deltafin.protocol.chat import ChatCompletionRequest, JsonSchemaFormat, ResponseFormat
from deltafin.protocol.common import StreamOptions
from deltafin.protocol.responses import InputItemsQuery, ResponsesRequest
from deltafin.rules import RuleContext
from deltafin.serving.chat import ChatService
from deltafin.serving.context import RequestStats, ServingContext
from deltafin.serving.responses.conversation import chat_messages
from deltafin.serving.responses.events import ResponseEvents, sse
from deltafin.serving.responses.items import Item, canonical_input
from deltafin.serving.responses.output import ResponseShape
from deltafin.serving.responses.store import DamagedRecord, ResponseStore, StoreUnavailable, decode_record
from deltafin.serving.responses.tools import ServedTools, chat_tool_choice, served_tools
from deltafin.serving.responses.truncation import TurnCosts, without_turns
from deltafin.serving.sse import StreamingResponse
from deltafin.serving.thinking_budget import check_budget

log = structlog.get_logger("deltafin.responses")

DROPPED_TOOLS_HEADER = "x-deltafin-dropped-tools"
#: on a response asked to be stored that could not be (the database unavailable, larger than the bounds): its
#: body says `store: false`, and the log line why
STORE_ERROR_HEADER = "x-deltafin-store"
T = TypeVar("T")


class ResponsesService:
    def __init__(self, ctx: ServingContext, chat: ChatService, store: ResponseStore, *, developer_role: bool) -> None:
        self.ctx = ctx
        self.chat = chat
        self.store = store
        self._developer_role = developer_role

    # --- the store, always off the loop: records are conversations (megabytes) and sqlite touches disk

    async def _store_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except StoreUnavailable as exc:
            raise EngineUnavailableError(
                f"{exc.reason}; retry later.", code="response_store_unavailable", headers={"Retry-After": "1"}
            ) from None

    async def _record(self, owner: str, response_id: str, param: str | None = None) -> tuple[dict[str, Any], int]:
        """The stored record and its size in bytes; 404 for an unknown id, another key's, or a damaged record."""
        what = "Previous response" if param == "previous_response_id" else "Response"
        try:
            found = await self._store_call(_read_record, self.store, owner, response_id)
        except DamagedRecord as exc:
            log.error("response_record_damaged", response_id=response_id, reason=str(exc))
            raise NotFoundError(
                f"{what} with id '{response_id}' cannot be read: its stored record is damaged ({exc}).",
                param=param,
                code="response_not_found",
            ) from None
        if found is None:
            raise NotFoundError(f"{what} with id '{response_id}' not found.", param=param, code="response_not_found")
        return found

    # --- create

    async def create(self, request: ResponsesRequest, stats: RequestStats) -> dict[str, Any] | StreamingResponse:
        request.check()
        self.ctx.check_model(request.model)
        budget, budget_field = request.budget
        check_budget(budget, self.ctx.config.model, self.ctx.model_name, param=budget_field)
        tools = served_tools(request.tools, unsupported=self.ctx.config.server.responses.unsupported_tools)
        if tools.dropped:
            dropped = ",".join(tools.dropped)
            stats.headers.append((DROPPED_TOOLS_HEADER, dropped))
            log.warning(
                "responses_tools_dropped",
                tools=tools.dropped,
                reason="hosted tools run on OpenAI's side; left out of the prompt",
            )
        context: list[Item] = []
        if request.previous_response_id is not None:
            record, size = await self._record(stats.owner, request.previous_response_id, "previous_response_id")
            context = [*record["context"], *record["input"], *record["response"]["output"]]
            # The prompt is rendered from the stored conversation too: its size, not the (tiny) body's, chooses
            # where the work runs (a 3.8 MB conversation rendered on the event loop froze every client for 9 s).
            stats.body_bytes += size
        new_items = await self._off_loop(canonical_input, request.input, stats=stats)
        if not new_items and not context:
            raise InvalidRequestError("input must not be empty", param="input")
        shape = ResponseShape(request, tools, self.ctx.model_name, defaults=self.ctx.sampling_defaults)
        items = [*context, *new_items]
        record = {"input": new_items, "context": context}
        costs: TurnCosts | None = None
        turns_dropped = 0
        if request.truncation == "auto" and stats.body_bytes >= self.ctx.config.server.queue.large_body_bytes:
            # A large conversation is measured before its first render, and cut by the estimate: rendering all
            # of it only to learn it does not fit is seconds of template work (3.8 MB: ~1M tokens for a context
            # of thousands) that also holds the GIL the engine's thread needs between its steps.
            costs = await self._off_loop(TurnCosts, items, self.ctx.count_tokens, stats=stats)
            estimate = costs.cut(
                limit=self.ctx.engine.context_length,
                completion=request.max_output_tokens or 0,
                prompt_tokens=None,
            )
            turns_dropped = estimate or 0
        while True:
            cut = items if turns_dropped == 0 else without_turns(items, turns_dropped)
            chat_request = await self._off_loop(self._chat_request, request, tools, cut, stats=stats)
            rule_ctx = self.chat.rule_context(chat_request)
            try:
                if request.stream:
                    frame = self._framer(shape, rule_ctx, stats.owner, record)
                    return await self.chat.create(chat_request, stats, frame=frame, rule_ctx=rule_ctx)
                completion = await self.chat.create(chat_request, stats, rule_ctx=rule_ctx)
                break
            except DeltafinError as err:
                if request.truncation != "auto" or err.code != "context_length_exceeded":
                    raise
                if costs is None:  # each item's tokens, counted once whatever the number of cuts
                    costs = await self._off_loop(TurnCosts, items, self.ctx.count_tokens, stats=stats)
                more = costs.cut(
                    limit=self.ctx.engine.context_length,
                    completion=getattr(err, "completion_tokens", None) or (request.max_output_tokens or 0),
                    prompt_tokens=getattr(err, "prompt_tokens", None),
                    dropped=turns_dropped,
                )
                if more is None:
                    raise
                turns_dropped = more
        assert isinstance(completion, dict)  # not streamed: the whole chat completion
        body = shape.from_chat(completion, rule_ctx.reasoning_tokens)
        if request.stores and not await self._keep(stats.owner, body, record):
            body["store"] = False
            stats.headers.append((STORE_ERROR_HEADER, "not stored"))
        return body

    async def _off_loop(self, fn: Callable[..., T], *args: Any, stats: RequestStats) -> T:
        """Conversation work (checking items, building messages, counting tokens) where the prompt's render runs:
        on the loop for a small conversation, on a prompt thread for a large one."""
        return await self.ctx.off_loop(fn, *args, size=stats.body_bytes, stats=stats)

    async def _keep(self, owner: str, body: dict[str, Any], record: dict[str, Any]) -> bool:
        """Store the response; False when it could not be (too large for the bounds, the database unavailable):
        the answer is still the client's, marked `store: false`, and the reason is logged."""
        try:
            return bool(await asyncio.to_thread(self.store.put, owner, body["id"], {**record, "response": body}))
        except StoreUnavailable as exc:
            log.error("response_not_stored", response_id=body["id"], reason=exc.reason)
            return False

    def _framer(self, shape: ResponseShape, rule_ctx: RuleContext, owner: str, record: dict[str, Any]) -> Any:
        stores = shape.request.stores

        def frame(
            chunks: AsyncIterator[dict], map_error: Callable[[DeltafinError], DeltafinError], close: Callable[[], None]
        ) -> AsyncIterator[bytes]:
            events = ResponseEvents(shape, lambda: rule_ctx.reasoning_tokens)

            async def body() -> AsyncIterator[bytes]:
                held = b""  # response.created leaves with response.in_progress: one write
                try:
                    async for event in events.events(chunks):
                        if event["type"] == "response.created":
                            held = sse(event)
                            continue
                        final = event["type"] in ("response.completed", "response.incomplete")
                        if final and stores and not await self._keep(owner, event["response"], record):
                            event["response"]["store"] = False
                        yield held + sse(event)
                        held = b""
                except DeltafinError as exc:
                    yield held + b"".join(sse(event) for event in events.failed(map_error(exc)))
                except Exception as exc:  # anything else after the stream began: response.failed, never a cut
                    log.exception("responses_stream_failed")
                    failure = DeltafinError(f"The response failed: {type(exc).__name__}.")
                    yield held + b"".join(sse(event) for event in events.failed(failure))
                finally:
                    close()

            return body()

        return frame

    def _chat_request(self, request: ResponsesRequest, tools: ServedTools, items: list[Item]) -> ChatCompletionRequest:
        return chat_request(
            request,
            tools,
            items,
            developer_role=self._developer_role,
            thinking_kwarg=self.ctx.config.model.thinking_kwarg,
            model_name=self.ctx.model_name,
        )

    # --- retrieve, delete, input items

    async def retrieve(self, owner: str, response_id: str) -> dict[str, Any]:
        return (await self._record(owner, response_id))[0]["response"]

    async def delete(self, owner: str, response_id: str) -> dict[str, Any]:
        if not await self._store_call(self.store.delete, owner, response_id):
            raise NotFoundError(f"Response with id '{response_id}' not found.", code="response_not_found")
        return {"id": response_id, "object": "response", "deleted": True}

    async def input_items(self, owner: str, response_id: str, query: InputItemsQuery) -> dict[str, Any]:
        if query.order not in ("asc", "desc"):
            raise InvalidRequestError("order must be 'asc' or 'desc'", param="order")
        items = list((await self._record(owner, response_id))[0]["input"])
        if query.order == "desc":
            items.reverse()
        if query.after is not None:
            ids = [item.get("id") for item in items]
            if query.after not in ids:
                raise InvalidRequestError(f"after: no input item {query.after!r} in this response", param="after")
            items = items[ids.index(query.after) + 1 :]
        page = items[: query.limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }


def _read_record(store: ResponseStore, owner: str, response_id: str) -> tuple[dict[str, Any], int] | None:
    """On a worker thread: the record's bytes, decoded and its items checked as a request's would be (a stored
    record another program changed must not reach the prompt: DamagedRecord)."""
    body = store.get_raw(owner, response_id)
    if body is None:
        return None
    record = decode_record(body)
    try:
        for items in (record["context"], record["input"], record["response"]["output"]):
            canonical_input(items)  # checked only: the record is returned as it was stored
    except InvalidRequestError as exc:
        raise DamagedRecord(exc.message) from None
    return record, len(body)


def chat_request(
    request: ResponsesRequest,
    tools: ServedTools,
    items: list[Item],
    *,
    developer_role: bool,
    thinking_kwarg: str | None,
    model_name: str,
) -> ChatCompletionRequest:
    """The chat request a Responses request (with its whole conversation, `items`) is served as."""
    messages = chat_messages(request.instructions, items, developer_role=developer_role)
    if not messages:
        raise InvalidRequestError("input must not be empty", param="input")
    tool_choice, definitions = chat_tool_choice(request.tool_choice, tools)
    kwargs, effort = _reasoning(request, thinking_kwarg, model_name)
    logprobs = request.includes("message.output_text.logprobs")
    return ChatCompletionRequest(
        model=request.model,
        messages=messages,
        tools=definitions or None,
        tool_choice=tool_choice,
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=_response_format(request),
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        repetition_penalty=request.repetition_penalty,
        stream=request.stream,
        stream_options=StreamOptions(include_usage=True) if request.stream else None,
        user=request.user,
        logprobs=logprobs,
        top_logprobs=request.top_logprobs if logprobs else None,
        chat_template_kwargs=kwargs or None,
        reasoning_effort=effort,
        thinking_token_budget=request.budget[0],
    )


def _reasoning(request: ResponsesRequest, key: str | None, model_name: str) -> tuple[dict[str, Any], str | None]:
    """reasoning.effort onto the family's thinking controls: "none"/"minimal" turn thinking off, the others turn
    it on and pass the effort on as chat's `reasoning_effort` (for formats that render it). On a model without a
    thinking switch, asking for reasoning is a 400."""
    effort = request.reasoning.effort if request.reasoning is not None else None
    if effort is None:
        return {}, None
    thinking = effort not in ("none", "minimal")
    if key is None:
        if thinking:
            raise InvalidRequestError(
                f"The model `{model_name}` does not reason; reasoning.effort {effort!r} cannot be served "
                "(leave it out, or send 'none')",
                param="reasoning.effort",
            )
        return {}, None
    return {key: thinking}, effort if thinking else None


def _response_format(request: ResponsesRequest) -> ResponseFormat | None:
    fmt = request.text.format if request.text is not None else None
    if fmt is None:
        return None
    if fmt.type != "json_schema":
        return ResponseFormat(type=fmt.type)
    return ResponseFormat(
        type="json_schema",
        json_schema=JsonSchemaFormat(name=fmt.name, description=fmt.description, schema=fmt.schema, strict=fmt.strict),
    )
