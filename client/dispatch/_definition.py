"""``Definition``: one tool, its JSON Schema, and the never-raising call.

Guarantees: a Definition is read-only once built, and a bad name, risk or
schema fails at construction (``ValidationError``). ``call`` checks the
arguments against the schema with ``jsonschema`` (Draft 2020-12), whose
messages are what a model reads; a compiled fast check (``_fastcheck``) may
say yes first, only where it provably agrees. ``call`` never raises but for a
``KeyboardInterrupt``: invalid arguments, an exception from the function and a
return value that is not a ``Result`` all come back as ``Result.failure``.
Re-exported by ``dispatch.tools``.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any, cast, get_args

import jsonschema

from dispatch import _schemas
from dispatch._fastcheck import fast_check_for, is_flat
from dispatch._plain import non_string_key, plain
from dispatch._result import Result
from dispatch.errors import ExecutionError, ValidationError
from dispatchd.catalogue import Risk

__all__ = ["Definition", "ToolFunc"]

# What OpenAI and Anthropic accept as a tool name. fullmatch, not ``$``, so a
# trailing newline is refused too.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_RISKS: tuple[str, ...] = get_args(Risk)  # "read", "write", "execute": dispatchd/catalogue.py spells them

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
                 "_validator", "_fast", "_flat", "_origin")

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
        schema = plain(parameters)  # our own copy: what we advertise is what we check
        odd = non_string_key(schema)
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
        self._flat = False  # set once _fast is compiled: it is a flat schema's check (_fastcheck.is_flat)
        self._origin: Definition | None = None  # the Definition _with_func copied this one from

    def _with_func(self, func: ToolFunc) -> Definition:
        """This tool calling ``func`` instead: its checked schema and validator
        shared, both read-only (a session's registry is the daemon's same
        tools each time; checking them again cost about 25 µs a tool)."""
        if not callable(func):
            raise TypeError(f"{self._name}: func must be callable")
        twin = object.__new__(Definition)
        for slot in Definition.__slots__:
            object.__setattr__(twin, slot, getattr(self, slot))
        twin._func = func
        twin._origin = self
        return twin

    @property
    def name(self) -> str:
        return self._name

    @property
    def description(self) -> str:
        return self._description

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON Schema, as a fresh copy."""
        return cast(dict[str, Any], plain(self._parameters))

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
        return self._check({} if params is None else plain(params))

    def _check(self, params: Any) -> tuple[bool, list[str]]:
        if isinstance(params, dict):
            odd = [k for k in params if not isinstance(k, str)]
            if odd:
                return False, [f"argument names must be strings, not {odd[0]!r}"]
        fast = self._fast
        if fast is _NOT_COMPILED:
            fast = self._compile_fast()
        if fast is not None and fast(params):
            return True, []  # jsonschema would agree (see _fastcheck); it is 7x slower
        messages = []
        for err in sorted(self._validator.iter_errors(params), key=lambda e: e.json_path):
            where = "" if err.json_path == "$" else f"{err.json_path}: "
            messages.append(where + _shorten(err.message))
        return not messages, messages

    def _compile_fast(self) -> Any:
        fast = self._fast = fast_check_for(self._parameters)
        # After _fast: a thread that reads _flat True finds _fast compiled.
        self._flat = fast is not None and is_flat(fast)
        origin = self._origin
        if origin is not None and origin._fast is _NOT_COMPILED:
            # The twins made from it later (the next sessions' registries)
            # start compiled: a session's first call of a tool looked its
            # check up again (a json.dumps of the schema, 11-30 µs).
            origin._fast = fast
            origin._flat = self._flat
        return fast

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
        if self._flat and type(params) is dict:
            # _arguments' usual case written out here (see there): a flat
            # schema's exact arguments, copied and checked, without the call
            # and the tuple it returns (about 1,500 instructions a call).
            copied = params.copy()
            if self._fast(copied):
                if on_output is not None:
                    return self._invoke(copied, context, on_output)
                # _invoke's usual case written out: one Python call fewer
                # (about 1,300 instructions a call under callgrind, a session's
                # read_file); the same catches and check.
                try:
                    result = self._func(copied, {} if context is None else context)
                except (Exception, SystemExit) as exc:  # SystemExit: a tool's sys.exit() must not end the agent
                    return Result.failure(str(ExecutionError.wrapping(self._name, exc)))
                if isinstance(result, Result):
                    return result
                return Result.failure(f"{self._name}: the tool returned {type(result).__name__}, not a Result")
        args, failure = self._arguments(params)
        if failure is not None:
            return failure
        # Not cast(dict[str, Any], args): a call and a new generic alias on every call.
        assert args is not None  # (args, None) or (None, failure), which mypy cannot tie together
        return self._invoke(args, context, on_output)

    def _arguments(self, params: Any) -> tuple[dict[str, Any], None] | tuple[None, Result]:
        """``(args, None)`` with the func's own copy of valid ``params``, or
        ``(None, failure)``. Split from ``_invoke`` so a registry can ask for
        approval between the two, and only for a call that would run."""
        try:
            if self._flat and type(params) is dict:
                # The usual call: a flat schema's check passes only str keys
                # and exact str, int, float or bool values, so the dict's
                # shallow copy is the plain copy, with no null to drop, and a
                # yes is jsonschema's yes (_fastcheck): neither walk is needed.
                args = params.copy()
                if self._fast(args):
                    return args, None
            args = {} if params is None else plain(params)
            # A strict-mode model sends null for an optional argument it leaves out.
            # Only a null, or an object it may hold one in, can be dropped:
            # without either (most calls) there is nothing to walk or copy.
            if type(args) is not dict or None in args.values() or dict in map(type, args.values()):
                args = _schemas.drop_null_optionals(self._parameters, args)
            valid, messages = self._check(args)
        except Exception as exc:  # e.g. RecursionError copying absurdly deep params
            return None, Result.failure(str(ExecutionError.wrapping(self._name, exc)))
        if not valid:
            return None, Result.failure(str(ValidationError.invalid_arguments(self._name, messages)))
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

    # The same, under the name the dispatch-tools-interface plan gave it: part
    # of the public contract (CONTRACT.md, "The tool interface"), so it stays.
    to_tool_definition = to_dict

    def __repr__(self) -> str:
        return f"Definition(name={self._name!r}, risk={self._risk!r}, advertised={self._advertised})"


# jsonschema quotes the offending value; a model that sent a whole file where a
# number belongs should not have the file read back to it.
_MAX_MESSAGE = 300


def _shorten(message: str) -> str:
    return message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 1] + "…"

