"""Model providers' shapes, each spelled once: tool schemas, tool calls, replies, messages.

One class per provider a conversation can be held with (``OpenAIChat``,
``OpenAIResponses``, ``Anthropic``) says, side by side, how that provider
writes a tool call and how it is answered, how an assistant message is read
and written, and which schema format it is shown. ``read_tool_call`` is the
inverse of the classes' ``tool_call``: it recognises a tool call of any of
them. ``SCHEMA_FORMATS`` shapes a tool's plain dict for every format
``Registry.schemas`` knows (the three above, plus plain, json, mcp, gemini).

Guarantees: every function here is pure (it builds fresh dicts and changes
nothing it is given) and takes dicts or SDK objects alike (``field``); none
raises on a malformed tool call but ``decode_arguments``, whose
``ValidationError`` carries the text a model is shown.

Users: ``Registry.run_call`` (read a call, answer it), ``dispatch.agent``
(the conversation loop and ``FakeModel``), ``dispatch.mcp`` (an MCP call
is run as an Anthropic ``tool_use``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from dispatch import _schemas
from dispatch._plain import json_type
from dispatch.errors import ValidationError

__all__ = [
    "PROVIDERS",
    "SCHEMA_FORMATS",
    "STRICT_FORMATS",
    "Anthropic",
    "OpenAIChat",
    "OpenAIResponses",
    "Provider",
    "Reply",
    "decode_arguments",
    "field",
    "guess_reply",
    "provider",
    "read_tool_call",
    "reply_content",
]

Tool = dict[str, Any]

Reply = Callable[[str, str, bool], dict[str, Any]]
"""``reply(call_id, text, failed)``: the message answering one tool call."""


# ---------------------------------------------------------------- reading dicts and SDK objects


def field(obj: Any, key: str) -> Any:
    """``obj[key]`` for a mapping, ``obj.key`` otherwise (SDK objects); None if absent."""
    if isinstance(obj, Mapping):
        return obj.get(key)
    return getattr(obj, key, None)


def dump(obj: Any) -> Any:
    """An SDK object (pydantic, or any plain object) as plain dicts and lists."""
    if isinstance(obj, Mapping):
        return {k: dump(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [dump(v) for v in obj]
    if hasattr(obj, "model_dump"):
        return obj.model_dump(exclude_none=True)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return {k: dump(v) for k, v in vars(obj).items() if not k.startswith("_") and v is not None}
    return obj


def _arguments_json(arguments: Any) -> str:
    """Arguments as an OpenAI model sends them: a str is sent as it is (so a
    script can send broken JSON), anything else as JSON."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _error_text(text: str, failed: bool) -> str:
    # OpenAI's shapes have no error flag: the content says it.
    return f"Error: {text}" if failed else text


# ---------------------------------------------------------------- the providers


class OpenAIChat:
    """OpenAI Chat Completions: the assistant's ``tool_calls``, answered by one
    ``{"role": "tool"}`` message each."""

    schema_format = "openai"
    id_prefix = "call_"

    @staticmethod
    def tool_call(call_id: str, name: Any, arguments: Any) -> dict[str, Any]:
        return {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": _arguments_json(arguments)}}

    @staticmethod
    def reply(call_id: str, text: str, failed: bool) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": call_id, "content": _error_text(text, failed)}

    @staticmethod
    def add(history: list[Any], message: Any) -> None:
        history.append(message)

    @staticmethod
    def message(reply: Any) -> dict[str, Any]:
        if isinstance(reply, Mapping):
            return dict(reply)
        # Only what the API takes back: an SDK message also has refusal, audio...
        message: dict[str, Any] = {"role": "assistant", "content": field(reply, "content")}
        calls = field(reply, "tool_calls")
        if calls:
            message["tool_calls"] = dump(list(calls))
        return message

    @staticmethod
    def tool_calls(message: Mapping[str, Any]) -> list[Any]:
        return list(message.get("tool_calls") or [])

    @staticmethod
    def text(message: Mapping[str, Any]) -> str | None:
        content = message.get("content")
        if isinstance(content, list):  # content parts
            return "".join(str(field(p, "text") or "") for p in content)
        return content

    @staticmethod
    def answers(replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return replies

    @staticmethod
    def assistant(text: str | None, calls: list[Any]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return message


class Anthropic:
    """Anthropic Messages: ``tool_use`` blocks, answered by one user message of
    ``tool_result`` blocks."""

    schema_format = "anthropic"
    id_prefix = "toolu_"
    add = OpenAIChat.add

    @staticmethod
    def tool_call(call_id: str, name: Any, arguments: Any) -> dict[str, Any]:
        return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}

    @staticmethod
    def reply(call_id: str, text: str, failed: bool) -> dict[str, Any]:
        return {"type": "tool_result", "tool_use_id": call_id, "content": text, "is_error": failed}

    @staticmethod
    def message(reply: Any) -> dict[str, Any]:
        if isinstance(reply, Mapping) and set(reply) <= {"role", "content"}:
            return dict(reply)
        # An SDK Message (or its dict) also carries id, model, usage...: the API
        # takes back only role and content.
        return {"role": "assistant", "content": dump(field(reply, "content"))}

    @staticmethod
    def tool_calls(message: Mapping[str, Any]) -> list[Any]:
        content = message.get("content")
        if isinstance(content, str) or not content:
            return []
        return [b for b in content if field(b, "type") == "tool_use"]

    @staticmethod
    def text(message: Mapping[str, Any]) -> str | None:
        content = message.get("content")
        if isinstance(content, str) or content is None:
            return content
        return "".join(str(field(b, "text") or "") for b in content if field(b, "type") == "text")

    @staticmethod
    def answers(replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": replies}]

    @staticmethod
    def assistant(text: str | None, calls: list[Any]) -> dict[str, Any]:
        content: list[Any] = [{"type": "text", "text": text}] if text else []
        return {"role": "assistant", "content": content + calls}


class OpenAIResponses:
    """The OpenAI Responses API: a conversation is a flat list of input items,
    and a reply is the response's ``output`` list (messages, reasoning,
    function calls), which goes back into the input as it is; each
    ``function_call`` is answered by a ``function_call_output`` item."""

    schema_format = "openai-responses"
    id_prefix = "fc_"

    @staticmethod
    def tool_call(call_id: str, name: Any, arguments: Any) -> dict[str, Any]:
        return {"type": "function_call", "call_id": call_id, "name": name, "arguments": _arguments_json(arguments)}

    @staticmethod
    def reply(call_id: str, text: str, failed: bool) -> dict[str, Any]:
        return {"type": "function_call_output", "call_id": call_id, "output": _error_text(text, failed)}

    @staticmethod
    def message(reply: Any) -> list[Any]:
        output = reply if isinstance(reply, (list, tuple)) else field(reply, "output")
        if output is None and isinstance(reply, Mapping):
            output = [reply]  # a single item
        return [dump(item) for item in output or []]

    @staticmethod
    def add(history: list[Any], message: list[Any]) -> None:
        history.extend(message)

    @staticmethod
    def tool_calls(message: list[Any]) -> list[Any]:
        return [item for item in message if field(item, "type") == "function_call"]

    @staticmethod
    def text(message: list[Any]) -> str | None:
        parts = [str(field(c, "text") or "") for item in message if field(item, "type") == "message"
                 for c in (field(item, "content") or []) if field(c, "type") in ("output_text", "text")]
        return "".join(parts) if parts else None

    @staticmethod
    def answers(replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return replies

    @staticmethod
    def assistant(text: str | None, calls: list[Any]) -> list[Any]:
        items: list[Any] = []
        if text:
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": text}]})
        return items + calls


Provider = type[OpenAIChat] | type[Anthropic] | type[OpenAIResponses]
PROVIDERS: dict[str, Provider] = {"openai": OpenAIChat, "openai-responses": OpenAIResponses,
                                  "anthropic": Anthropic}


def provider(name: str) -> Provider:
    """The provider called ``name``; ValueError naming the known ones otherwise."""
    try:
        return PROVIDERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown provider {name!r}; known: {', '.join(PROVIDERS)}") from None


# ---------------------------------------------------------------- a tool call as a model returned it


def read_tool_call(tool_call: Any) -> tuple[str, Any, Any, Reply] | None:
    """``(call_id, name, arguments, reply)`` of a tool call of a known shape, else None."""
    kind = field(tool_call, "type")
    function = field(tool_call, "function")
    reply: Reply
    if kind == "tool_use":
        call_id, name, arguments = (field(tool_call, k) for k in ("id", "name", "input"))
        reply = Anthropic.reply
    elif kind == "function_call":
        call_id, name, arguments = (field(tool_call, k) for k in ("call_id", "name", "arguments"))
        reply = OpenAIResponses.reply
    elif function is not None:
        call_id = field(tool_call, "id")
        name, arguments = field(function, "name"), field(function, "arguments")
        reply = OpenAIChat.reply
    else:
        return None
    return ("" if call_id is None else str(call_id)), name, arguments, reply


def guess_reply(tool_call: Any) -> tuple[str, Reply]:
    """For a call of no known shape: its id, if it has one under any provider's
    name, and the reply shape its keys suggest (OpenAI chat when nothing does)."""
    guesses: tuple[tuple[str, Reply], ...] = (
        ("call_id", OpenAIResponses.reply), ("tool_use_id", Anthropic.reply),
        ("input", Anthropic.reply), ("id", OpenAIChat.reply), ("tool_call_id", OpenAIChat.reply))
    for key, reply in guesses:
        try:
            value = field(tool_call, key)
        except Exception:  # an odd object whose attributes raise
            value = None
        if value is None:
            continue
        if key == "input":  # an Anthropic-like block: its id is "id"
            found = field(tool_call, "id")
            return ("" if found is None else str(found)), reply
        return str(value), reply
    return "", OpenAIChat.reply


def decode_arguments(name: str, arguments: Any) -> Any:
    """The arguments of a tool call as an object; ValidationError if they are not one."""
    if isinstance(arguments, (str, bytes)):
        if not arguments.strip():  # some models send "" for a tool without parameters
            return {}
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as exc:
            raise ValidationError.invalid_arguments(name, [f"arguments are not valid JSON: {exc}"]) from exc
    if arguments is None:
        return {}
    if not isinstance(arguments, Mapping):
        raise ValidationError.invalid_arguments(
            name, [f"arguments must be a JSON object, not {json_type(arguments)}"]
        )
    return arguments


def reply_content(reply: Mapping[str, Any]) -> str:
    """The text a reply (any provider's ``reply``) shows the model."""
    text = reply.get("content", reply.get("output", ""))
    return text if isinstance(text, str) else json.dumps(text)


# ---------------------------------------------------------------- tool schemas


def _openai_schema(tool: Tool, strict: bool) -> Tool:
    function = {**tool, "parameters": _schemas.strict_schema(tool["parameters"])} if strict else dict(tool)
    if strict:
        function["strict"] = True
    return {"type": "function", "function": function}


def _responses_schema(tool: Tool, strict: bool) -> Tool:
    params = _schemas.strict_schema(tool["parameters"]) if strict else tool["parameters"]
    # The SDK's FunctionToolParam requires "strict": present either way.
    return {"type": "function", "name": tool["name"], "description": tool["description"],
            "parameters": params, "strict": strict}


def _gemini_schema(tool: Tool, _strict: bool) -> Tool:
    return {"name": tool["name"], "description": tool["description"],
            "parameters": _schemas.gemini_schema(tool["parameters"])}


SCHEMA_FORMATS: dict[str, Callable[[Tool, bool], Tool]] = {
    "plain": lambda d, _s: d,
    "json": lambda d, _s: d,  # what `dispatch tools --format json` calls plain
    "openai": _openai_schema,
    "openai-responses": _responses_schema,
    "anthropic": lambda d, _s: {
        "name": d["name"], "description": d["description"], "input_schema": d["parameters"]
    },
    "mcp": lambda d, _s: {
        "name": d["name"], "description": d["description"], "inputSchema": d["parameters"]
    },
    "gemini": _gemini_schema,
}
"""``shape(tool, strict)`` per format: a tool's plain dict (``Definition.to_dict``)
as that format wants it."""
STRICT_FORMATS = ("openai", "openai-responses")
