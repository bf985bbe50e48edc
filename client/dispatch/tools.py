"""The tool interface: what a tool is, where tools are kept, what a call returns.

- ``Result`` is what every tool call returns: success with an ``output``, or
  failure with an ``error``, plus opaque ``metadata`` for the agent loop (never
  sent to a model). Immutable.
- ``Definition`` is one tool: a name, a description, a JSON Schema for its
  parameters and a function. ``Definition.call`` never raises.
- ``Registry`` holds definitions by name, hands out their schemas in the shape
  a model provider wants (``schemas``) and runs a tool call as the model
  returned it (``dispatch``), answering in that provider's shape. ``call`` and
  ``dispatch`` never raise. It may ask an approval callback before a write or
  execute tool runs, and show a model long results in part (head, tail, and
  an id for ``retrieve_output``), keeping the whole in an ``OutputStore``.

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

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import inspect
import itertools
import json
import re
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast, get_args

import jsonschema

from dispatch import _schemas
from dispatch._fastcheck import fast_check_for
from dispatchd.tools.spec import Risk

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
# Also public, though not in __all__ yet (tests/unit/test_tools_registry.py pins
# it): Approval, OutputStore, ToolCallOutcome, RETRIEVE_OUTPUT, compact.


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


def _non_string_key(value: Any) -> Any:
    """The first dict key anywhere in ``value`` (plain containers) that is not a str, or None."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return key
            found = _non_string_key(item)
            if found is not None:
                return found
    elif isinstance(value, list):
        for item in value:
            found = _non_string_key(item)
            if found is not None:
                return found
    return None


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
    def _from_wire(cls, success: bool, text: str, metadata: dict[str, Any]) -> Result:
        """A Result from a decoded reply: ``text`` a str, ``metadata`` a fresh
        plain dict nobody else holds (msgspec just made it), so the checks and
        the deep copy of ``__post_init__`` have nothing to do (about 2 µs a
        call saved)."""
        result = object.__new__(cls)
        put = object.__setattr__  # frozen: go around __setattr__, as __post_init__ does
        put(result, "is_success", success)
        put(result, "output", text if success else None)
        put(result, "error", None if success else text)
        put(result, "metadata", types.MappingProxyType(metadata))
        return result

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
_RISKS: tuple[str, ...] = get_args(Risk)  # "read", "write", "execute": dispatchd/tools/spec.py spells them

ToolFunc = Callable[[dict[str, Any], Any], Result]


_VALIDATORS: dict[str, jsonschema.Draft202012Validator] = {}
_NOT_COMPILED = object()
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
    tool absent from the schemas a model is shown, and callable by the
    application (``Registry.call``) but not by a model (``Registry.dispatch``),
    unless the registry says ``allow_hidden=True``.

    ``risk`` defaults to ``"execute"``: a tool that does not say what it does
    is asked about like one that runs commands (fail closed). Say
    ``risk="read"`` for a tool that only reads.
    """

    __slots__ = ("_name", "_description", "_parameters", "_func", "_risk", "_advertised",
                 "_validator", "_fast")

    def __init__(
        self,
        name: str,
        description: str,
        parameters: Mapping[str, Any],
        func: ToolFunc,
        *,
        risk: str = "execute",
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
        odd = _non_string_key(schema)
        if odd is not None:
            # JSON has none; {1: ...} and {"1": ...} would also share a cached validator.
            raise ValidationError(f"{name}: parameters must be JSON: the key {odd!r} is not a string", tool=name)
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
        self._fast: Any = _NOT_COMPILED  # compiled on the first call (1-3 ms; most tools are never called)

    @property
    def name(self) -> str:
        return self._name

    @property
    def description(self) -> str:
        return self._description

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON Schema, as a fresh copy."""
        return cast(dict[str, Any], _plain(self._parameters))

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

    @classmethod
    def from_function(cls, func: Callable[..., Any], *, name: str | None = None,
                      description: str | None = None, risk: str = "execute",
                      advertised: bool = True) -> Definition:
        """A tool from a typed Python function: its name, its docstring's first
        paragraph as the description, a JSON Schema from its signature (types,
        defaults; parameter descriptions from a Google ``Args:`` section or
        Sphinx ``:param x:`` lines). See ``dispatch._fromfunc``."""
        from dispatch._fromfunc import definition_parts

        fname, fdesc, schema, run = definition_parts(func)
        return cls(name or fname, fdesc if description is None else description, schema, run,
                   risk=risk, advertised=advertised)

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
        fast = self._fast
        if fast is _NOT_COMPILED:
            fast = self._fast = fast_check_for(self._parameters)
        if fast is not None and fast(params):
            return True, []  # jsonschema would agree (see _fastcheck); it is 7x slower
        messages = []
        for err in sorted(self._validator.iter_errors(params), key=lambda e: e.json_path):
            where = "" if err.json_path == "$" else f"{err.json_path}: "
            messages.append(where + _shorten(err.message))
        return not messages, messages

    def call(self, params: Any, context: Any = None, on_output: Callable[[str, str], None] | None = None) -> Result:
        """Validate ``params``, run the function. Never raises, but for a
        ``KeyboardInterrupt`` (a Ctrl-C stops a direct call as it stops any code;
        ``Registry.dispatch`` answers the model instead). ``SystemExit`` is a failure.

        Invalid arguments, an exception from the function and a return value
        that is not a ``Result`` all come back as ``Result.failure`` naming the tool.
        No approval is asked here: that is the ``Registry``'s job.

        ``on_output(stream, text)``, ``stream`` "stdout" or "stderr", gets a
        tool's output as it comes (a session's ``shell_exec``), before the
        Result returns; it reaches a function marked ``func.streams_output =
        True`` (as a third argument, ``on_output``) and is ignored for others.
        """
        args, failure = self._arguments(params)
        if failure is not None:
            return failure
        return self._invoke(cast(dict[str, Any], args), context, on_output)

    def _arguments(self, params: Any) -> tuple[dict[str, Any], None] | tuple[None, Result]:
        """``(args, None)`` with the func's own copy of valid ``params``, or
        ``(None, failure)``. Split from ``_invoke`` so a registry can ask for
        approval between the two, and only for a call that would run."""
        try:
            args = {} if params is None else _plain(params)
            # A strict-mode model sends null for an optional argument it leaves out.
            args = _schemas.drop_null_optionals(self._parameters, args)
            valid, messages = self._check(args)
        except Exception as exc:  # e.g. RecursionError copying absurdly deep params
            return None, Result.failure(str(ExecutionError.wrapping(self._name, exc)))
        if not valid:
            return None, Result.failure(str(_invalid_arguments(self._name, messages)))
        return args, None

    def _invoke(self, args: dict[str, Any], context: Any,
                on_output: Callable[[str, str], None] | None = None) -> Result:
        try:
            if on_output is not None and getattr(self._func, "streams_output", False):
                result = self._func(args, {} if context is None else context, on_output)  # type: ignore[call-arg]
            else:
                result = self._func(args, {} if context is None else context)
        except Exception as exc:
            return Result.failure(str(ExecutionError.wrapping(self._name, exc)))
        except SystemExit as exc:  # a tool's sys.exit() must not end the agent
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


# ---------------------------------------------------------------- outputs a model sees in part

RETRIEVE_OUTPUT = "retrieve_output"


class OutputStore:
    """The whole text of tool results a model was shown only in part, by id.

    Bounded: it keeps the last ``max_outputs`` texts and at most ``max_bytes``
    of them (UTF-8), forgetting the oldest first; a text larger than
    ``max_bytes`` on its own is still kept, alone, until the next one comes.
    Safe to share between threads, and between registries: ``subset`` and
    ``with_approval`` hand theirs on, so an id a model was given stays valid.
    """

    def __init__(self, max_outputs: int = 64, max_bytes: int = 32 * 1024 * 1024) -> None:
        if max_outputs < 1 or max_bytes < 1:
            raise ValueError("an OutputStore keeps at least one output of at least one byte")
        self.max_outputs = max_outputs
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._texts: dict[str, tuple[str, int]] = {}  # id -> (text, UTF-8 size), oldest first
        self._ids_of: dict[str, str] = {}  # text -> id: the same output twice is kept once (seed 003)
        self._bytes = 0
        self._ids = itertools.count(1)

    def put(self, text: str) -> str:
        """Keep ``text``; returns its id (``out_1``, ``out_2``…). A text already
        kept is not kept twice: it gets the id it had, and counts as the newest."""
        size = _utf8_size(text)
        with self._lock:
            output_id = self._ids_of.get(text)
            if output_id is not None:
                self._texts[output_id] = self._texts.pop(output_id)  # the newest again
                return output_id
            output_id = f"out_{next(self._ids)}"
            self._texts[output_id] = (text, size)
            self._ids_of[text] = output_id
            self._bytes += size
            while len(self._texts) > 1 and (
                len(self._texts) > self.max_outputs or self._bytes > self.max_bytes
            ):
                oldest = next(iter(self._texts))
                gone, gone_size = self._texts.pop(oldest)
                self._ids_of.pop(gone, None)
                self._bytes -= gone_size
        return output_id

    def get(self, output_id: str) -> str | None:
        """The text kept under ``output_id``, or None (never kept, or forgotten)."""
        with self._lock:
            found = self._texts.get(output_id) if isinstance(output_id, str) else None
        return None if found is None else found[0]

    def __contains__(self, output_id: object) -> bool:
        with self._lock:
            return output_id in self._texts

    def __len__(self) -> int:
        with self._lock:
            return len(self._texts)

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def __repr__(self) -> str:
        return f"OutputStore({len(self)} outputs, {self.total_bytes} bytes)"


def _utf8_size(text: str) -> int:
    # surrogatepass: a lone surrogate (from a tool that decoded bytes oddly)
    # must not turn a size check into an exception on the never-raising path.
    return len(text.encode("utf-8", "surrogatepass"))


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _text(data: bytes) -> str:
    """Bytes cut at character boundaries (``_char_start``) back to text."""
    try:
        return data.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:  # not cut where it should have been: drop the pieces
        return data.decode("utf-8", "ignore")


def _char_start(data: bytes, i: int) -> int:
    """``i``, or the start of the UTF-8 character that byte ``i`` is inside."""
    while 0 < i < len(data) and data[i] & 0xC0 == 0x80:  # a continuation byte
        i -= 1
    return i


def _char_after(data: bytes, i: int) -> int:
    """``i``, or the start of the UTF-8 character after the one byte ``i`` is inside."""
    while 0 < i < len(data) and data[i] & 0xC0 == 0x80:
        i += 1
    return i


def _marker(omitted: int, output_id: str) -> str:
    return (f'\n[... {omitted} bytes omitted; call {RETRIEVE_OUTPUT} with id "{output_id}" '
            "for the whole output ...]\n")


def compact(text: str, budget: int, output_id: str) -> str:
    """``text`` when it fits in ``budget`` bytes (UTF-8); otherwise its head and
    tail around a marker naming ``output_id``, the whole at most ``budget``
    bytes (or the marker alone, when even that does not fit).

    Each side is cut at a line break when one falls in its outer half, so a
    model sees whole lines; half the room goes to each side, because the end of
    an output (the error, the test summary) matters as much as its start.
    """
    data = _utf8(text)
    if len(data) <= budget:
        return text
    room = max(budget - len(_utf8(_marker(len(data), output_id))), 0)  # the longest marker
    head = data[: _char_start(data, room // 2)]
    tail_n = room - room // 2
    tail = data[_char_after(data, len(data) - tail_n):] if tail_n else b""
    cut = head.rfind(b"\n")
    if cut >= len(head) // 2:
        head = head[: cut + 1]
    cut = tail.find(b"\n")
    if 0 <= cut < len(tail) // 2:
        tail = tail[cut + 1:]
    marker = _marker(len(data) - len(head) - len(tail), output_id)
    if head.endswith(b"\n"):
        marker = marker[1:]  # no blank line between a whole line and the marker
    return _text(head) + marker + _text(tail)


def _retrieve_output_tool(store: OutputStore, budget: int) -> Definition:
    """``retrieve_output``: a piece of an output that a model saw compacted.

    By lines (``start_line``/``end_line``, 0-based and inclusive like
    ``read_file``) or by bytes (``offset``/``length``); a piece is at most
    ``budget`` bytes, and a footer says where the next one starts.
    """

    def run(params: dict[str, Any], _context: Any) -> Result:
        output_id = params["id"]
        text = store.get(output_id)
        if text is None:
            return Result.failure(
                f"{RETRIEVE_OUTPUT}: no output with id {output_id!r} (only the last "
                f"{store.max_outputs} compacted outputs are kept)")
        by_bytes = "offset" in params or "length" in params
        if by_bytes and ("start_line" in params or "end_line" in params):
            return Result.failure(f"{RETRIEVE_OUTPUT}: give lines (start_line, end_line) "
                                  "or bytes (offset, length), not both")
        piece, footer, meta = (_piece_by_bytes if by_bytes else _piece_by_lines)(text, params, budget)
        meta = {"id": output_id, **meta}
        if footer:
            piece += ("" if piece.endswith("\n") or not piece else "\n") + f"[output {output_id}: {footer}]"
        return Result.success(piece, meta)

    return Definition(
        RETRIEVE_OUTPUT,
        "Read a piece of a tool output that was too long to show whole (its marker gives the id). "
        f"Ask by lines (0-based, inclusive) or by bytes; a piece is at most {budget} bytes and "
        "says where the next one starts.",
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "description": "the id in the marker, e.g. out_1"},
                "start_line": {"type": "integer", "minimum": 0,
                               "description": "first line, 0-based (default 0)"},
                "end_line": {"type": "integer", "minimum": -1,
                             "description": "last line, inclusive; -1 for the end (default)"},
                "offset": {"type": "integer", "minimum": 0,
                           "description": "instead of lines: the first byte (0-based)"},
                "length": {"type": "integer", "minimum": 1,
                           "description": f"with offset: how many bytes (at most {budget})"},
            },
            "required": ["id"],
            "additionalProperties": False,
        },
        run,
        risk="read",
    )


def _piece_by_lines(text: str, params: Mapping[str, Any], budget: int) -> tuple[str, str, dict[str, Any]]:
    lines = text.splitlines(keepends=True)
    total = len(lines)
    start = params.get("start_line", 0)
    end = params.get("end_line", -1)
    last = total - 1 if end == -1 else min(end, total - 1)
    meta: dict[str, Any] = {"total_lines": total, "total_bytes": _utf8_size(text)}
    if start >= total or last < start:
        return "", f"no lines {start}-{'end' if end == -1 else end}; it has {total}", meta
    out: list[bytes] = []
    size = 0
    shown = start - 1
    for n in range(start, last + 1):
        line = _utf8(lines[n])
        if size + len(line) > budget:
            if not out:  # one line longer than the budget: its first part, then bytes
                offset = len(_utf8("".join(lines[:n])))
                piece = _text(line[: _char_start(line, budget)])
                meta.update(start_line=n, end_line=n)
                return piece, (f"line {n} is longer than {budget} bytes; the rest of it from "
                               f"offset={offset + len(_utf8(piece))}"), meta
            break
        out.append(line)
        size += len(line)
        shown = n
    meta.update(start_line=start, end_line=shown)
    if shown < last:
        footer = f"lines {start}-{shown} of {total}; more from start_line={shown + 1}"
    elif start > 0 or shown < total - 1:
        footer = f"lines {start}-{shown} of {total}"
    else:
        footer = ""
    return b"".join(out).decode("utf-8", "surrogatepass"), footer, meta


def _piece_by_bytes(text: str, params: Mapping[str, Any], budget: int) -> tuple[str, str, dict[str, Any]]:
    data = _utf8(text)
    offset = _char_after(data, params.get("offset", 0))
    end = offset + min(params.get("length", budget), budget)
    if end < len(data):  # whole characters, so that the next piece starts on one
        start_of = _char_start(data, end)
        end = start_of if start_of > offset else _char_after(data, end)
    chunk = data[offset:end]
    end = offset + len(chunk)
    meta: dict[str, Any] = {"total_bytes": len(data), "offset": offset, "length": len(chunk)}
    if end < len(data):
        footer = f"bytes {offset}-{end} of {len(data)}; more from offset={end}"
    elif offset > 0:
        footer = f"bytes {offset}-{end} of {len(data)}"
    else:
        footer = ""
    return _text(chunk), footer, meta


# ---------------------------------------------------------------- Registry

Approval = Callable[[Definition, dict[str, Any], Any], "bool | str"]
"""``approve(definition, params, context)``: True runs the call; a str denies it, saying why."""

_NEEDS_APPROVAL = ("write", "execute")

_SCHEMA_FORMATS = _schemas.FORMATS


class Registry:
    """Tools by name, in registration order.

    Safe to share between threads: ``register`` builds a new table under a lock
    and swaps it in whole, and every reader works on the table it picked up, so
    no reader sees a half-registered tool. Tools are only ever added.
    ``tools``, ``tool_names``, ``size``, ``len`` and lookups cover every tool;
    ``to_list``, ``schemas`` and the "Available tools" a model is told cover
    only advertised ones.

    Two settings, fixed at construction (``with_approval``, ``subset`` make
    new registries that keep them):

    - ``approve(definition, params, context)``: asked by ``call`` and
      ``dispatch`` before a ``write`` or ``execute`` tool runs, with arguments
      already validated. Only ``True`` lets the call run; a str is a denial
      with that reason, anything else (``False``, ``None``, an exception) a
      denial without one. A denial is ``Result.failure("<tool>: denied by
      approval: <reason>")`` with metadata ``{"denied": True, "reason"}``.
      ``Definition.call`` asks no one: the registry is the gate.
      ``approve`` may be a coroutine function (``async def``): its answer is
      awaited, on the caller's event loop when the call came through
      ``dispatch.aio``, else on a loop of its own.
    - ``allow_hidden``: whether a model may call a tool that is not advertised
      (``Definition(advertised=False)``). By default it may not: ``dispatch``
      and ``run_call`` answer as for an unknown tool (seed 002: a model must
      not commit facts itself). ``call(name, ...)`` is the application's own
      call, and runs hidden tools either way.
    - ``output_budget`` (bytes): ``dispatch``, the path to a model, shows a
      result longer than this as head and tail around a marker; the whole text
      goes to ``outputs`` (an ``OutputStore``), and a ``retrieve_output`` tool,
      registered here, gives a model the rest piece by piece. ``call`` always
      returns the whole ``Result``.
    """

    def __init__(
        self,
        tools: Iterable[Definition] = (),
        *,
        approve: Approval | None = None,
        output_budget: int | None = None,
        outputs: OutputStore | None = None,
        allow_hidden: bool = False,
    ) -> None:
        if approve is not None and not callable(approve):
            raise TypeError("approve must be callable: approve(definition, params, context)")
        if output_budget is not None and (
            isinstance(output_budget, bool) or not isinstance(output_budget, int) or output_budget < 1
        ):
            raise ValueError(f"output_budget must be a positive number of bytes, not {output_budget!r}")
        if outputs is not None and output_budget is None:
            raise ValueError("outputs are kept only for a registry with an output_budget")
        self._lock = threading.Lock()
        self._tools: dict[str, Definition] = {}
        self._approve = approve
        self._allow_hidden = bool(allow_hidden)
        self._budget = output_budget
        self._outputs = outputs if outputs is not None or output_budget is None else OutputStore()
        for defn in tools:
            self.register(defn)
        # A marker names retrieve_output, so a compacting registry always has
        # one (a registry made from another's tools already holds its twin).
        if self._budget is not None and RETRIEVE_OUTPUT not in self._tools:
            assert self._outputs is not None
            self.register(_retrieve_output_tool(self._outputs, self._budget))

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
        """A new registry with just ``names``, in the order given; an unknown name raises.

        It keeps this registry's approval and output budget (and store); when
        the budget is set, ``retrieve_output`` comes along, last, unless named.
        """
        tools = self._tools
        picked: dict[str, Definition] = {}
        for name in names:
            if not isinstance(name, str):
                raise TypeError(f"subset() takes names as separate str arguments, not {name!r}")
            if name not in tools:
                raise ToolNotFoundError(name, tools)
            picked[name] = tools[name]
        if RETRIEVE_OUTPUT in tools and self._budget is not None:
            picked.setdefault(RETRIEVE_OUTPUT, tools[RETRIEVE_OUTPUT])
        return self._like(picked.values(), self._approve)

    def with_approval(self, approve: Approval | None) -> Registry:
        """A new registry with the same tools, budget and store, asking ``approve``
        (None: asking no one)."""
        return self._like(self._tools.values(), approve)

    def _like(self, tools: Iterable[Definition], approve: Approval | None) -> Registry:
        return Registry(tools, approve=approve, output_budget=self._budget, outputs=self._outputs,
                        allow_hidden=self._allow_hidden)

    @property
    def allow_hidden(self) -> bool:
        """Whether a model's tool call may run a tool that is not advertised."""
        return self._allow_hidden

    @property
    def approve(self) -> Approval | None:
        return self._approve

    @property
    def output_budget(self) -> int | None:
        return self._budget

    @property
    def outputs(self) -> OutputStore | None:
        """Where whole outputs go when a model sees them in part (None without a budget)."""
        return self._outputs

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

    def schemas(self, format: str = "plain", *, strict: bool = False) -> list[dict[str, Any]]:
        """The advertised tools in a provider's shape: plain (or json), openai,
        openai-responses, anthropic, mcp, gemini (function declarations).
        Another format raises ValueError.

        ``strict=True`` (openai and openai-responses only) gives OpenAI's
        strict-mode shapes: every property required, the optional ones
        nullable, ``additionalProperties: false``; a null argument is then
        read as "not given". openai-responses always carries ``strict``.
        """
        try:
            shape = _SCHEMA_FORMATS[format]
        except (KeyError, TypeError):
            known = ", ".join(_SCHEMA_FORMATS)
            raise ValueError(f"unknown schema format {format!r}; known: {known}") from None
        if strict and format not in _schemas.STRICT_FORMATS:
            raise ValueError(f"strict=True is for {' and '.join(_schemas.STRICT_FORMATS)}, not {format!r}")
        return [shape(d, bool(strict)) for d in self.to_list()]

    def call(self, name: str, params: Any, context: Any = None,
             on_output: Callable[[str, str], None] | None = None) -> Result:
        """Run tool ``name``, asking for approval first when its risk needs it.
        Never raises: an unknown name, invalid arguments and a denial are failures.
        ``on_output`` as in ``Definition.call``."""
        defn = self._find(name)
        if defn is None:
            return self._unknown(name)
        args, failure = defn._arguments(params)
        if args is None:
            return failure  # type: ignore[return-value]
        denial = self._ask(defn, args, context)
        return denial if denial is not None else defn._invoke(args, context, on_output)

    def _ask(self, defn: Definition, args: dict[str, Any], context: Any) -> Result | None:
        """None when the call may run; the denial otherwise. Fails closed."""
        if self._approve is None or defn.risk not in _NEEDS_APPROVAL:
            return None
        try:
            answer = self._approve(defn, _plain(args), context)  # a copy: what it saw is what runs
            if inspect.isawaitable(answer):
                answer = _await(answer)
        except Exception as exc:
            answer = f"the approval callback failed: {type(exc).__name__}: {exc}"
        if answer is True:
            return None
        reason = answer.strip() if isinstance(answer, str) else ""
        return Result.failure(
            f"{defn.name}: denied by approval" + (f": {reason}" if reason else ""),
            {"denied": True, "reason": reason},
        )

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
        an object, invalid arguments and a denied approval all come back as
        content the model can read. OpenAI shapes have no error flag, so there
        the content of a failure starts with ``"Error: "``. A tool call of no
        known shape gets an error reply keeping its id (``id``, ``call_id``…)
        in the shape its keys suggest (OpenAI Chat Completions when none do).
        A tool that is not advertised is unknown here unless ``allow_hidden``.
        With an ``output_budget``, long content is compacted (see the class).
        ``run_call`` does the same and also returns the whole ``Result``.
        """
        return self.run_call(tool_call, context).reply

    def run_call(self, tool_call: Any, context: Any = None,
                 on_output: Callable[[str, str], None] | None = None) -> ToolCallOutcome:
        """``dispatch``, returning everything an agent loop or a trace wants to know
        (``on_output`` as in ``Definition.call``)."""
        shape = _read_tool_call(tool_call)
        if shape is None:
            result = Result.failure(
                "unrecognised tool call: expected an OpenAI tool call with a 'function', "
                "an OpenAI Responses 'function_call' or an Anthropic 'tool_use' block"
            )
            call_id, reply = _guess_reply(tool_call)
            return ToolCallOutcome(call_id, None, None, result, reply(call_id, str(result), True), None)
        call_id, name, arguments, reply = shape
        try:
            params: Any = _decode_arguments(name, arguments)
            bad_arguments = None
        except ValidationError as exc:
            params, bad_arguments = arguments, Result.failure(str(exc))
        defn = self._find(name)
        if defn is None or not (defn.advertised or self._allow_hidden):
            # Before the arguments: the name is the first thing to fix. A
            # hidden tool is the application's, not the model's (seed 002).
            result = self._unknown(name)
        elif bad_arguments is not None:
            result = bad_arguments
        else:
            try:
                result = self.call(name, params, context, on_output)
            except KeyboardInterrupt as exc:
                # Ctrl-C during a model's call ends that call, not the
                # conversation: the model's call is answered, and
                # run_tool_loop stops ("interrupted") once the turn is.
                result = Result.failure(str(ExecutionError.wrapping(name, exc)), {"interrupted": True})
        text, output_id = self._for_model(name, result)
        return ToolCallOutcome(call_id, name, params, result, reply(call_id, text, result.is_failure), output_id)

    def _for_model(self, name: object, result: Result) -> tuple[str, str | None]:
        """The text a model reads, and the id of the whole when that text is a part."""
        text = str(result)
        budget = self._budget
        # retrieve_output's pieces are already cut to the budget, footer aside.
        if budget is None or name == RETRIEVE_OUTPUT or len(text) * 4 <= budget:
            return text, None
        if _utf8_size(text) <= budget:
            return text, None
        assert self._outputs is not None
        output_id = self._outputs.put(text)
        return compact(text, budget, output_id), output_id

    def _unknown(self, name: object) -> Result:
        # Only advertised names: a hidden tool stays hidden from the model.
        advertised = [d.name for d in self._tools.values() if d.advertised]
        return Result.failure(str(ToolNotFoundError(name, advertised)))


@dataclasses.dataclass(frozen=True)
class ToolCallOutcome:
    """What ``Registry.run_call`` made of one tool call."""

    call_id: str
    """The provider's id of the call (``""`` when it had none)."""
    name: Any
    """The tool named, as given (None when the call named none)."""
    arguments: Any
    """The arguments as an object when they could be decoded, else as given."""
    result: Result
    """The whole result (compaction only touches ``reply``)."""
    reply: dict[str, Any]
    """The provider-shaped message for the model."""
    output_id: str | None
    """Where the whole output is kept when ``reply`` shows only part of it."""


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


def _guess_reply(tool_call: Any) -> tuple[str, _Reply]:
    """For a call of no known shape: its id, if it has one under any provider's
    name, and the reply shape its keys suggest (OpenAI chat when nothing does)."""
    for key, reply in (("call_id", _responses_reply), ("tool_use_id", _anthropic_reply),
                       ("input", _anthropic_reply), ("id", _openai_reply),
                       ("tool_call_id", _openai_reply)):
        try:
            value = _field(tool_call, key)
        except Exception:  # an odd object whose attributes raise
            value = None
        if value is None:
            continue
        if key == "input":  # an Anthropic-like block: its id is "id"
            found = _field(tool_call, "id")
            return ("" if found is None else str(found)), reply
        return str(value), reply
    return "", _openai_reply


def _await(awaitable: Any) -> Any:
    """The value of an awaitable, from synchronous code: on the event loop of
    the ``dispatch.aio`` caller that brought us here when there is one, else
    on a loop of our own (in another thread if this one already runs one)."""
    loop = _CALLER_LOOP.get()
    if loop is not None and loop.is_running():
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop:
            return asyncio.run_coroutine_threadsafe(_as_coroutine(awaitable), loop).result()
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_as_coroutine(awaitable))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # this thread's loop is busy calling us
        return pool.submit(asyncio.run, _as_coroutine(awaitable)).result()


async def _as_coroutine(awaitable: Any) -> Any:
    return await awaitable


_CALLER_LOOP: contextvars.ContextVar[asyncio.AbstractEventLoop | None] = contextvars.ContextVar(
    "dispatch_caller_loop", default=None)
"""Set by ``dispatch.aio`` around the threads it runs calls in (``to_thread`` copies it)."""


def _read_tool_call(tool_call: Any) -> tuple[str, Any, Any, _Reply] | None:
    """``(call_id, name, arguments, reply)`` of a tool call of a known shape, else None."""
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
        return None
    return ("" if call_id is None else str(call_id)), name, arguments, reply


_Reply = Callable[[str, str, bool], dict[str, Any]]


def _error_text(text: str, failed: bool) -> str:
    return f"Error: {text}" if failed else text


def _openai_reply(call_id: str, text: str, failed: bool) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": _error_text(text, failed)}


def _responses_reply(call_id: str, text: str, failed: bool) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": _error_text(text, failed)}


def _anthropic_reply(call_id: str, text: str, failed: bool) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": call_id, "content": text, "is_error": failed}
