"""Tool-calling conversations: the `tools` column and assistant `tool_calls`, read, checked and normalised.

A tool row is a `messages` row (TRL's conversational shape) with, optionally:

- a `tools` column: a list of JSON schemas (OpenAI's `{type: function, function: {name, description,
  parameters}}`, or the bare `{name, description, parameters}`), or a JSON string of one; `parameters` a JSON
  schema object or a JSON string of one;
- assistant messages with `tool_calls`: `[{type: function, function: {name, arguments}, id?}]`, the
  arguments a JSON object or a JSON string of one (a list of calls may be a JSON string too);
- `role: tool` messages with the results (`content`, and `tool_call_id` / `name` where given).

Every template we ship renders a call's arguments with `tojson` (Llama-3.1, gpt-oss) or verbatim when
they are a string (Qwen3): arguments are normalised to a JSON object, so a JSON string and the object
it holds train the very same tokens on every template. Tools are normalised to the OpenAI shape, which
is what each template reads (gpt-oss reads `tool.function`).

Stored (`stored_row`) and trained (`as_trained`) rows carry the tools and the calls as JSON strings,
so that Arrow never merges the schemas of different rows into one struct full of nulls; the tools
ride on the first message (`TOOLS_FIELD`), so that a tool conversation travels wherever a
conversation does (mixtures, streams, packed blocks, eval, the audit) and the masking renders each row
with its own tools (`masking.py`).
"""

from __future__ import annotations

import json
from typing import Any

from sft_recipes.data.rows import (
    INVALID_TOOL_ARGUMENTS,
    INVALID_TOOL_CALL,
    INVALID_TOOLS,
    ORPHAN_TOOL_RESULT,
    UNKNOWN_TOOL,
)

TOOLS_FIELD = "tools"  # the row's tool schemas (a JSON string) on the first message of a trained conversation


class ToolDataError(ValueError):
    """A row's tools or tool calls cannot be read; `reason` is its `rows.py` drop reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _without_nulls(value: Any) -> Any:
    """A schema without null-valued keys: Arrow fills every key of every row's schema, null where a row has none."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def parsed_tools(value: Any) -> list[dict[str, Any]] | None:
    """The tools as OpenAI-shaped schemas, None for none; ToolDataError(INVALID_TOOLS) when unreadable."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ToolDataError(INVALID_TOOLS, f"the tools are not valid JSON ({error})") from None
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise ToolDataError(INVALID_TOOLS, "the tools are not a list of JSON schemas")
    tools = []
    for tool in _without_nulls(value):
        function = tool.get("function", tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolDataError(INVALID_TOOLS, "a tool has no name (expected {type: function, function: {name, ...}})")
        tools.append({"type": "function", "function": _with_parameters_read(function)})
    return tools or None


def _with_parameters_read(function: dict[str, Any]) -> dict[str, Any]:
    """A tool's `parameters` as a JSON schema object: a JSON string of one is read (some datasets store them so), as
    a call's arguments are, so that both train the same tokens; anything else is refused, not rendered as a string."""
    parameters = function.get("parameters")
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters)
        except json.JSONDecodeError as error:
            raise ToolDataError(INVALID_TOOLS, f"tool {function['name']!r}: its parameters are not valid JSON "
                                               f"({error})") from None
    if parameters is not None and not isinstance(parameters, dict):
        raise ToolDataError(INVALID_TOOLS, f"tool {function['name']!r}: its parameters are not a JSON schema object "
                                           f"(got {type(parameters).__name__})")
    return function if parameters is None else {**function, "parameters": parameters}


def parsed_tool_calls(value: Any) -> list[dict[str, Any]]:
    """An assistant message's calls as `{type: function, function: {name, arguments: {...}}, id?}`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ToolDataError(INVALID_TOOL_CALL, "tool_calls is a string that is not JSON") from None
    if not isinstance(value, list) or not value:
        raise ToolDataError(INVALID_TOOL_CALL, "tool_calls is not a non-empty list of calls")
    calls = []
    for call in value:
        if not isinstance(call, dict):
            raise ToolDataError(INVALID_TOOL_CALL, "a tool call is not an object")
        function = call.get("function") if call.get("function") is not None else call
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolDataError(INVALID_TOOL_CALL, "a tool call has no function name")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise ToolDataError(INVALID_TOOL_ARGUMENTS, f"the arguments of {function['name']} are not JSON") from None
        if not isinstance(arguments, dict):
            raise ToolDataError(INVALID_TOOL_ARGUMENTS, f"the arguments of {function['name']} are not a JSON object")
        normalised = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            normalised["id"] = call["id"]
        calls.append(normalised)
    return calls


def tool_problem(messages: list[dict[str, Any]], tools: Any) -> str | None:
    """The row rules of tool conversations (after the plain message rules): readable tools and calls, every
    call to a tool in `tools`, every result answering a call made before it."""
    try:
        schemas = parsed_tools(tools)
        names = {tool["function"]["name"] for tool in schemas or ()}
        pending: list[str | None] = []  # the calls of the last assistant message not answered yet (their ids)
        for message in messages:
            if message.get("role") == "assistant":
                pending = []
                if message.get("tool_calls") is None:
                    continue
                for call in parsed_tool_calls(message["tool_calls"]):
                    if call["function"]["name"] not in names:
                        return UNKNOWN_TOOL
                    pending.append(call.get("id"))
            elif message.get("role") == "tool":
                call_id = message.get("tool_call_id")
                if not pending or (call_id is not None and None not in pending and call_id not in pending):
                    return ORPHAN_TOOL_RESULT
                pending.remove(call_id if call_id in pending else pending[0])
            elif message.get("role") == "user":
                pending = []
    except ToolDataError as error:
        return error.reason
    return None


def has_tool_content(messages: Any, tools: Any) -> bool:
    return bool(tools) or (isinstance(messages, list) and any(
        isinstance(message, dict) and (message.get("tool_calls") is not None or message.get("role") == "tool")
        for message in messages))


def stored_conversation(messages: list[dict[str, Any]], tools: Any) -> list[dict[str, Any]]:
    """A checked tool conversation as it is stored and trained: calls and tools as canonical JSON strings, the
    tools on the first message. Arguments keep their key order (templates render them in that order)."""
    stored = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        if message.get("tool_calls") is not None:
            message["tool_calls"] = json.dumps(parsed_tool_calls(message["tool_calls"]), ensure_ascii=False)
            message.setdefault("content", "")
        stored.append(message)
    schemas = parsed_tools(tools)
    if schemas:
        stored[0] = {**stored[0], TOOLS_FIELD: json.dumps(schemas, ensure_ascii=False)}
    return stored
