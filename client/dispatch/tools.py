"""The tool interface: what a tool is, where tools are kept, what a call returns.

- ``Result`` is what every tool call returns: success with an ``output``, or
  failure with an ``error``, plus opaque ``metadata`` for the agent loop (never
  sent to a model). Immutable.
- ``Definition`` is one tool: a name, a description, a JSON Schema for its
  parameters and a function. ``Definition.call`` never raises.
- ``Registry`` holds definitions by name, hands out their schemas in the shape
  a model provider wants (``schemas``) and runs a tool call as the model
  returned it (``dispatch``), answering in that provider's shape. ``call`` and
  ``dispatch`` never raise.

Errors, for use outside the never-raising ``call``/``dispatch`` paths::

    Error                      base of every error raised here
    ├── DuplicateToolError     register() was given a name already taken  (name)
    ├── ToolNotFoundError      get()/subset() was given an unknown name   (name; also a LookupError)
    ├── ValidationError        a bad definition or bad arguments          (tool, errors; also a ValueError)
    └── ExecutionError         a tool's function raised                   (tool; __cause__ is the exception)

``ValidationError`` and ``ExecutionError`` also give the failure messages that
``call`` returns, so the text a model reads is the text the exception carries.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jsonschema

__all__ = [
    "Definition",
    "DuplicateToolError",
    "Error",
    "ExecutionError",
    "Registry",
    "Result",
    "ToolNotFoundError",
    "ValidationError",
]


# ---------------------------------------------------------------- errors


class Error(Exception):
    """Base of every error this module raises."""


class DuplicateToolError(Error):
    def __init__(self, name: str) -> None:
        super().__init__(f"tool already registered: {name}")
        self.name = name


class ToolNotFoundError(Error, LookupError):
    """``str()`` is also what a model is told, so it lists what it may call instead."""

    def __init__(self, name: object, available: Iterable[str] = ()) -> None:
        self.name = name
        self.available = list(available)
        offer = (
            f"Available tools: {', '.join(self.available)}"
            if self.available
            else "No tools are available."
        )
        super().__init__(f"Unknown tool: {name}. {offer}")


class ValidationError(Error, ValueError):
    def __init__(self, message: str, *, tool: str = "", errors: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.tool = tool
        self.errors = list(errors)


class ExecutionError(Error):
    def __init__(self, message: str, *, tool: str = "") -> None:
        super().__init__(message)
        self.tool = tool

    @classmethod
    def wrapping(cls, tool: str, exc: BaseException) -> ExecutionError:
        """``"<tool>: <ExceptionType>: <message>"``, with ``exc`` as the cause."""
        try:
            detail = str(exc)
        except Exception:  # a broken __str__ must not make call() raise
            detail = ""
        kind = type(exc).__name__
        err = cls(f"{tool}: {kind}: {detail}" if detail else f"{tool}: {kind}", tool=tool)
        err.__cause__ = exc
        return err


def _invalid_arguments(tool: str, messages: Sequence[str]) -> ValidationError:
    return ValidationError(
        f"{tool}: invalid arguments: {'; '.join(messages)}", tool=tool, errors=messages
    )


# ---------------------------------------------------------------- helpers


def _plain(value: Any) -> Any:
    """A copy in plain JSON containers: mappings become dicts, lists and tuples lists.

    Other values are shared, not copied: JSON scalars are immutable anyway, and
    an opaque object (a handle in metadata, say) cannot always be copied.
    """
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for messages a model reads."""
    if value is None:
        return "null"
    for kind, name in ((bool, "boolean"), (str, "string"), ((int, float), "number"),
                       ((list, tuple), "array")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


# ---------------------------------------------------------------- Result


@dataclasses.dataclass(frozen=True, repr=False)
class Result:
    """The outcome of one tool call. Build it with ``success`` or ``failure``.

    Guarantees: a success has ``error`` None, a failure has ``output`` None;
    ``metadata`` is a read-only view of a deep copy taken at construction, so
    the caller's dict cannot change it later and ``to_dict`` hands out another
    copy (lists and dicts nested in the view are the result's own: leave them
    be); ``str()`` is the text a model reads (output or error, never metadata).
    """

    is_success: bool
    output: str | None = None
    error: str | None = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    # Results compare by value but are not hashable: metadata is a mapping.
    __hash__ = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if not isinstance(self.is_success, bool):
            raise TypeError("is_success must be a bool")
        text, other = (self.output, self.error) if self.is_success else (self.error, self.output)
        if not isinstance(text, str):
            field = "output" if self.is_success else "error"
            raise TypeError(f"Result {field} must be a str, not {type(text).__name__}")
        if other is not None:
            raise ValueError("a success has no error and a failure has no output")
        if not isinstance(self.metadata, Mapping):
            raise TypeError(f"metadata must be a mapping, not {type(self.metadata).__name__}")
        # Frozen dataclass: __setattr__ is blocked, so go around it, once, here.
        object.__setattr__(self, "metadata", types.MappingProxyType(_plain(self.metadata)))

    @classmethod
    def success(cls, output: str, metadata: Mapping[str, Any] | None = None) -> Result:
        return cls(True, output, None, metadata or {})

    @classmethod
    def failure(cls, error: str, metadata: Mapping[str, Any] | None = None) -> Result:
        return cls(False, None, error, metadata or {})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Result:
        """The inverse of ``to_dict`` (e.g. for a Result that came over the wire)."""
        metadata = data.get("metadata") or {}
        if data.get("success") is True:
            return cls.success(data.get("output"), metadata)  # type: ignore[arg-type]
        if data.get("success") is False:
            return cls.failure(data.get("error"), metadata)  # type: ignore[arg-type]
        raise ValueError("a Result dict needs 'success': true or false")

    @property
    def is_failure(self) -> bool:
        return not self.is_success

    def to_dict(self) -> dict[str, Any]:
        """``{"success", "output", "error", "metadata"}``; metadata as a fresh plain dict."""
        return {
            "success": self.is_success,
            "output": self.output,
            "error": self.error,
            "metadata": _plain(self.metadata),
        }

    def __str__(self) -> str:
        return self.output if self.is_success else self.error  # type: ignore[return-value]

    def __repr__(self) -> str:
        factory, text = ("success", self.output) if self.is_success else ("failure", self.error)
        extra = f", metadata={dict(self.metadata)!r}" if self.metadata else ""
        return f"Result.{factory}({text!r}{extra})"


# ---------------------------------------------------------------- Definition

# What OpenAI and Anthropic accept as a tool name. fullmatch, not ``$``, so a
# trailing newline is refused too.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_RISKS = ("read", "write", "execute")

ToolFunc = Callable[[dict[str, Any], Any], Result]


_VALIDATORS: dict[str, jsonschema.Draft202012Validator] = {}
_VALIDATORS_LOCK = threading.Lock()


def _validator_for(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    """A checked validator, made once per distinct schema: checking a schema
    costs about a millisecond, and every session's registry has the same ones."""
    key = json.dumps(schema, sort_keys=True, default=repr)
    with _VALIDATORS_LOCK:
        found = _VALIDATORS.get(key)
    if found is None:
        jsonschema.Draft202012Validator.check_schema(schema)
        found = jsonschema.Draft202012Validator(schema)
        with _VALIDATORS_LOCK:
            _VALIDATORS.setdefault(key, found)
    return found


class Definition:
    """One tool. Read-only once built; a bad name, risk or schema fails here.

    ``func(params, context)`` gets ``params`` as a fresh plain dict with str
    keys (changing it does not touch the caller's) and ``context`` as given
    (``{}`` when None; opaque to this module). ``advertised=False`` makes a
    tool callable by name but absent from the schemas a model is shown.
    """

    __slots__ = ("_name", "_description", "_parameters", "_func", "_risk", "_advertised",
                 "_validator")

    def __init__(
        self,
        name: str,
        description: str,
        parameters: Mapping[str, Any],
        func: ToolFunc,
        *,
        risk: str = "read",
        advertised: bool = True,
    ) -> None:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValidationError(
                f"tool name {name!r} must be 1 to 64 letters, digits, '_' or '-'", tool=str(name)
            )
        if not isinstance(description, str):
            raise ValidationError(f"{name}: description must be a str", tool=name)
        if risk not in _RISKS:
            raise ValidationError(
                f"{name}: risk must be one of {', '.join(_RISKS)}, not {risk!r}", tool=name
            )
        if not callable(func):
            raise TypeError(f"{name}: func must be callable")
        if not isinstance(parameters, Mapping):
            raise ValidationError(f"{name}: parameters must be a JSON Schema object", tool=name)
        schema = _plain(parameters)  # our own copy: what we advertise is what we check
        try:
            validator = _validator_for(schema)
        except jsonschema.SchemaError as exc:
            raise ValidationError(
                f"{name}: parameters are not a valid JSON Schema: {exc.message}", tool=name
            ) from exc
        # Every provider wants an object of named arguments at the top.
        if schema.get("type") != "object":
            raise ValidationError(f'{name}: parameters must have "type": "object"', tool=name)
        self._name = name
        self._description = description
        self._parameters = schema
        self._func = func
        self._risk = risk
        self._advertised = bool(advertised)
        self._validator = validator

    @property
    def name(self) -> str:
        return self._name

    @property
    def description(self) -> str:
        return self._description

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON Schema, as a fresh copy."""
        return _plain(self._parameters)

    @property
    def func(self) -> ToolFunc:
        return self._func

    @property
    def risk(self) -> str:
        """``"read"``, ``"write"`` or ``"execute"``."""
        return self._risk

    @property
    def advertised(self) -> bool:
        """Whether ``Registry.schemas`` shows this tool to models."""
        return self._advertised

    def validate_params(self, params: Any) -> tuple[bool, list[str]]:
        """``(valid, messages)``; a message names its JSON path unless it is the top.

        ``None`` counts as ``{}``.
        """
        return self._check({} if params is None else _plain(params))

    def _check(self, params: Any) -> tuple[bool, list[str]]:
        if isinstance(params, dict):
            odd = [k for k in params if not isinstance(k, str)]
            if odd:
                return False, [f"argument names must be strings, not {odd[0]!r}"]
        messages = []
        for err in sorted(self._validator.iter_errors(params), key=lambda e: e.json_path):
            where = "" if err.json_path == "$" else f"{err.json_path}: "
            messages.append(where + _shorten(err.message))
        return not messages, messages

    def call(self, params: Any, context: Any = None) -> Result:
        """Validate ``params``, run the function. Never raises (``Exception`` only).

        Invalid arguments, an exception from the function and a return value
        that is not a ``Result`` all come back as ``Result.failure`` naming the tool.
        """
        try:
            args = {} if params is None else _plain(params)  # the func's own copy
            valid, messages = self._check(args)
            if not valid:
                return Result.failure(str(_invalid_arguments(self._name, messages)))
            result = self._func(args, {} if context is None else context)
        except Exception as exc:
            return Result.failure(str(ExecutionError.wrapping(self._name, exc)))
        if not isinstance(result, Result):
            return Result.failure(
                f"{self._name}: the tool returned {type(result).__name__}, not a Result"
            )
        return result

    def to_dict(self) -> dict[str, Any]:
        """``{"name", "description", "parameters"}``, plain and fresh."""
        return {"name": self._name, "description": self._description, "parameters": self.parameters}

    to_tool_definition = to_dict

    def __repr__(self) -> str:
        return f"Definition(name={self._name!r}, risk={self._risk!r}, advertised={self._advertised})"


# jsonschema quotes the offending value; a model that sent a whole file where a
# number belongs should not have the file read back to it.
_MAX_MESSAGE = 300


def _shorten(message: str) -> str:
    return message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 1] + "…"


# ---------------------------------------------------------------- Registry

_SCHEMA_FORMATS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "plain": lambda d: d,
    "json": lambda d: d,  # what `dispatch tools --format json` calls plain
    "openai": lambda d: {"type": "function", "function": d},
    "openai-responses": lambda d: {"type": "function", **d},
    "anthropic": lambda d: {
        "name": d["name"], "description": d["description"], "input_schema": d["parameters"]
    },
    "mcp": lambda d: {
        "name": d["name"], "description": d["description"], "inputSchema": d["parameters"]
    },
}


class Registry:
    """Tools by name, in registration order.

    Safe to share between threads: ``register`` builds a new table under a lock
    and swaps it in whole, and every reader works on the table it picked up, so
    no reader sees a half-registered tool. Tools are only ever added.
    ``tools``, ``tool_names``, ``size``, ``len`` and lookups cover every tool;
    ``to_list``, ``schemas`` and the "Available tools" a model is told cover
    only advertised ones.
    """

    def __init__(self, tools: Iterable[Definition] = ()) -> None:
        self._lock = threading.Lock()
        self._tools: dict[str, Definition] = {}
        for defn in tools:
            self.register(defn)

    # -- building

    def register(self, defn: Definition) -> Registry:
        """Add ``defn``; returns the registry so calls chain."""
        if not isinstance(defn, Definition):
            raise TypeError(f"register() takes a Definition, not {type(defn).__name__}")
        with self._lock:
            if defn.name in self._tools:
                raise DuplicateToolError(defn.name)
            self._tools = {**self._tools, defn.name: defn}
        return self

    def subset(self, *names: str) -> Registry:
        """A new registry with just ``names``, in the order given; an unknown name raises."""
        tools = self._tools
        picked: dict[str, Definition] = {}
        for name in names:
            if not isinstance(name, str):
                raise TypeError(f"subset() takes names as separate str arguments, not {name!r}")
            if name not in tools:
                raise ToolNotFoundError(name, tools)
            picked[name] = tools[name]
        return Registry(picked.values())

    # -- reading

    def get(self, name: str) -> Definition:
        defn = self._find(name)
        if defn is None:
            raise ToolNotFoundError(name, self.tool_names)
        return defn

    def has(self, name: str) -> bool:
        return self._find(name) is not None

    def _find(self, name: object) -> Definition | None:
        # Not a str (None from a malformed tool call, a list...) is simply not found.
        return self._tools.get(name) if isinstance(name, str) else None

    @property
    def tools(self) -> list[Definition]:
        return list(self._tools.values())

    @property
    def tool_names(self) -> list[str]:
        return list(self._tools)

    @property
    def size(self) -> int:
        return len(self._tools)

    @property
    def is_empty(self) -> bool:
        return not self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def __iter__(self) -> Iterator[Definition]:
        return iter(list(self._tools.values()))

    def __contains__(self, item: object) -> bool:
        """A name, or a Definition (true when that very definition is registered)."""
        if isinstance(item, Definition):
            return self._tools.get(item.name) is item
        return self.has(item)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"Registry({self.tool_names!r})"

    # -- for models

    def to_list(self) -> list[dict[str, Any]]:
        """``to_dict()`` of each advertised tool."""
        return [d.to_dict() for d in self._tools.values() if d.advertised]

    def schemas(self, format: str = "plain") -> list[dict[str, Any]]:
        """The advertised tools in a provider's shape: plain (or json), openai,
        openai-responses, anthropic, mcp. Another format raises ValueError."""
        try:
            shape = _SCHEMA_FORMATS[format]
        except (KeyError, TypeError):
            known = ", ".join(_SCHEMA_FORMATS)
            raise ValueError(f"unknown schema format {format!r}; known: {known}") from None
        return [shape(d) for d in self.to_list()]

    def call(self, name: str, params: Any, context: Any = None) -> Result:
        """Run tool ``name``. Never raises: an unknown name is a failure."""
        defn = self._find(name)
        if defn is None:
            return self._unknown(name)
        return defn.call(params, context)

    def dispatch(self, tool_call: Any, context: Any = None) -> dict[str, Any]:
        """Run a tool call as a model returned it; answer in the same provider's shape.

        Takes a dict or an SDK object with the same attribute names:

        - OpenAI Chat Completions ``{"id", "type": "function", "function":
          {"name", "arguments"}}`` → ``{"role": "tool", "tool_call_id", "content"}``;
        - OpenAI Responses ``{"type": "function_call", "call_id", "name",
          "arguments"}`` → ``{"type": "function_call_output", "call_id", "output"}``;
        - Anthropic ``{"type": "tool_use", "id", "name", "input"}`` →
          ``{"type": "tool_result", "tool_use_id", "content", "is_error"}``.

        ``arguments`` may be a JSON string (empty means ``{}``) or already an
        object. Never raises: an unknown tool, bad JSON, arguments that are not
        an object and invalid arguments all come back as content the model can
        read. OpenAI shapes have no error flag, so there the content of a
        failure starts with ``"Error: "``. A tool call of no known shape gets
        an OpenAI-shaped error reply with ``tool_call_id`` ``""``.
        """
        kind = _field(tool_call, "type")
        function = _field(tool_call, "function")
        if kind == "tool_use":
            call_id, name, arguments = (_field(tool_call, k) for k in ("id", "name", "input"))
            reply = _anthropic_reply
        elif kind == "function_call":
            call_id, name, arguments = (_field(tool_call, k) for k in ("call_id", "name", "arguments"))
            reply = _responses_reply
        elif function is not None:
            call_id = _field(tool_call, "id")
            name, arguments = _field(function, "name"), _field(function, "arguments")
            reply = _openai_reply
        else:
            return _openai_reply("", Result.failure(
                "unrecognised tool call: expected an OpenAI tool call with a 'function', "
                "an OpenAI Responses 'function_call' or an Anthropic 'tool_use' block"
            ))
        call_id = "" if call_id is None else str(call_id)
        if not self.has(name):  # before the arguments: the name is the first thing to fix
            return reply(call_id, self._unknown(name))
        try:
            params = _decode_arguments(name, arguments)
        except ValidationError as exc:
            return reply(call_id, Result.failure(str(exc)))
        return reply(call_id, self.call(name, params, context))

    def _unknown(self, name: object) -> Result:
        # Only advertised names: a hidden tool stays hidden from the model.
        advertised = [d.name for d in self._tools.values() if d.advertised]
        return Result.failure(str(ToolNotFoundError(name, advertised)))


# ---------------------------------------------------------------- tool calls


def _field(obj: Any, key: str) -> Any:
    """``obj[key]`` for a mapping, ``obj.key`` otherwise (SDK objects); None if absent."""
    if isinstance(obj, Mapping):
        return obj.get(key)
    return getattr(obj, key, None)


def _decode_arguments(name: str, arguments: Any) -> Any:
    """The arguments of a tool call as an object; ValidationError if they are not one."""
    if isinstance(arguments, (str, bytes)):
        if not arguments.strip():  # some models send "" for a tool without parameters
            return {}
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as exc:
            raise _invalid_arguments(name, [f"arguments are not valid JSON: {exc}"]) from exc
    if arguments is None:
        return {}
    if not isinstance(arguments, Mapping):
        raise _invalid_arguments(
            name, [f"arguments must be a JSON object, not {_json_type(arguments)}"]
        )
    return arguments


def _error_text(result: Result) -> str:
    return str(result) if result.is_success else f"Error: {result}"


def _openai_reply(call_id: str, result: Result) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": _error_text(result)}


def _responses_reply(call_id: str, result: Result) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": _error_text(result)}


def _anthropic_reply(call_id: str, result: Result) -> dict[str, Any]:
    return {
        "type": "tool_result",
        "tool_use_id": call_id,
        "content": str(result),
        "is_error": result.is_failure,
    }
