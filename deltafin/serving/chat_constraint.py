"""The constraint a chat request is generated under, and the honest refusals around it.

- A forced tool_choice ("required" or a named function) on a model with a tool parser: the family's native
  tool-call markup (deltafin.markup), so its own parser reads the output unchanged.
- Otherwise `response_format` json_object / json_schema: JSON (after the reasoning block, on models that
  reason first); `text` or none: free generation.
- A forced tool_choice on a model without a tool parser (the default model): the call as plain JSON
  (deltafin.markup.forced_json, which also reads it back), as vLLM forces calls.
- `tools` to a model without a tool parser with tool_choice "auto" (or none given): 400, as vLLM answers,
  instead of dropping them silently. A constraint the engine cannot enforce: 400, instead of ignoring it.
- The constraint is checked and compiled by `ServingContext.grammars` (worker processes, bounded in time and
  by structural limits, outcomes cached) while the request waits in its own lane, before it asks the engine
  for room: a schema xgrammar refuses is a 400 naming the field; one over a limit or the time budget, a 400
  saying it is too complex.
Rules run before this, so a rule that rewrites tool_choice to "auto" (force_tool_choice_auto,
tool_choice_required_to_auto) turns enforcement off for that request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deltafin.errors import EngineUnavailableError, InvalidRequestError
from deltafin.families import BoundFamily
from deltafin.grammar import constraints
from deltafin.grammar.failures import WorkerLost
from deltafin.grammar.limits import TooComplex
from deltafin.markup.forced_json import forced_call_schema
from deltafin.markup.selection import ForcedCalls, forced_calls
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.protocol.sampling import Constraint

if TYPE_CHECKING:
    from deltafin.serving.context import RequestStats, ServingContext


@dataclass(frozen=True)
class ToolUse:
    """What a chat request's `tools` and `tool_choice` decide for the served family."""

    #: the output is read for tool calls (tools declared, and tool_choice is not "none")
    calls_allowed: bool
    #: the calls forced on a family without a tool-call syntax, generated and read back as plain JSON
    forced_json: ForcedCalls | None = None


def tool_use(request: ChatCompletionRequest, family: BoundFamily, served_name: str) -> ToolUse:
    """The request's tool use on `family`, or the 400 that says why it cannot be served."""
    if not request.tools and request.tool_choice not in (None, "auto", "none"):
        # A call cannot be forced from nothing; silently generating text would break the client's contract.
        raise InvalidRequestError("tool_choice requires tools to choose from", param="tool_choice")
    calls_allowed = bool(request.tools) and request.tool_choice != "none"
    if not calls_allowed or family.parses_tool_calls:
        return ToolUse(calls_allowed)
    try:
        forced = forced_calls(request.tools, request.tool_choice, parallel_tool_calls=request.parallel_tool_calls)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="tool_choice") from None
    if forced is None:
        raise InvalidRequestError(
            f"The model `{served_name}` (family {family.name}) has no tool-call parser, so it cannot choose to call "
            'tools. Send tool_choice "required" or a named function (the call is then forced as JSON), tool_choice '
            '"none", or no tools.',
            param="tools",
        )
    return ToolUse(calls_allowed, forced)


def _content_format(request: ChatCompletionRequest) -> dict[str, Any] | None:
    rf = request.response_format
    if rf is None or rf.type == "text":
        return None
    schema = rf.json_schema.schema if rf.type == "json_schema" and rf.json_schema else {"type": "object"}
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": constraints.MAX_WHITESPACE}


def request_constraint(
    request: ChatCompletionRequest, family: BoundFamily, prompt_text: str, tools: ToolUse | None = None
) -> tuple[Constraint, str] | None:
    """The constraint and the request field it comes from (for error messages), or None. `tools`: the request's
    `tool_use` when it was decided already."""
    if tools is None:
        tools = tool_use(request, family, family.name)
    if tools.forced_json is not None:
        return constraints.json_schema(forced_call_schema(tools.forced_json)), "tool_choice"
    if tools.calls_allowed:
        try:
            structure = family.tool_call_structure(
                request.tools or (),
                request.tool_choice,
                prompt_text=prompt_text,
                parallel_tool_calls=request.parallel_tool_calls,
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="tool_choice") from None
        if structure is not None:
            return constraints.structural_tag(structure), "tool_choice"
    content = _content_format(request)
    if content is None:
        return None
    structure = family.answer_structure(content, prompt_text=prompt_text)
    if structure is not None:
        return constraints.structural_tag(structure), "response_format"
    if request.response_format is not None and request.response_format.type == "json_object":
        return constraints.json_object(), "response_format"
    return constraints.json_schema(content["json_schema"]), "response_format"


async def prepared_constraint(found: tuple[Constraint, str], ctx: ServingContext, stats: RequestStats) -> Any:
    """A request's constraint (request_constraint) checked and compiled: its grammar ready for the engine, or
    None for an engine that compiles for itself. Raises the 400s (and the 429 of a request that got no grammar
    worker by its admission deadline)."""
    constraint, field = found
    if not ctx.engine.capabilities.grammar or ctx.grammars is None:
        raise InvalidRequestError(
            f"{field} cannot be enforced by this server's engine (no constrained decoding)", param=field
        )
    param = "response_format.json_schema.schema" if field == "response_format" else "tools"
    try:
        grammar, compile_s = await ctx.grammars.prepare(constraint, deadline=ctx.deadline(stats), owner=stats.owner)
    except WorkerLost:  # the server's failure (a worker killed from outside), not the constraint's: retry
        raise EngineUnavailableError(
            f"{param} could not be compiled: the grammar worker was lost; retry.",
            code="grammar_worker_lost",
            headers={"Retry-After": "1"},
        ) from None
    except TooComplex as exc:
        raise InvalidRequestError(f"{param} is too complex to enforce: {exc}", param=param) from None
    except ValueError as exc:
        raise InvalidRequestError(f"{param} cannot be enforced: {exc}", param=param) from None
    stats.prompt_work_s += compile_s  # the request's own work, like its render: not counted against its wait
    return grammar
