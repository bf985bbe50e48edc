"""A tool from a typed Python function: ``Definition.from_function(fn)``.

Guarantees:
- the JSON Schema comes from the signature: ``str``, ``int``, ``float``,
  ``bool``, ``list[T]``, ``tuple[T, ...]``, ``dict[str, T]``, ``Literal[...]``
  (an enum), ``X | None`` (nullable); an ``async def`` is awaited; a
  parameter with a default is optional and its default is advertised; an
  annotation it cannot express is refused with the parameter's name, at
  definition time, never at call time;
- descriptions: the docstring's first paragraph is the tool's; a parameter's
  comes from a Google ``Args:`` section or a Sphinx ``:param name:`` line;
- a parameter named ``context`` is not in the schema: it receives the call's
  context; ``*args``/``**kwargs`` are refused (a model cannot name them);
- the function's return value: a ``Result`` as it is; ``None`` as empty
  output; a str as the output; anything else as JSON (``default=str``).
"""

from __future__ import annotations

import collections.abc
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from typing import Any

from dispatch._asyncbridge import await_from_sync
from dispatch._result import Result

_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _schema_of(annotation: Any, where: str) -> dict[str, Any]:
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation]}
    if annotation is type(None):
        return {"type": "null"}
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        kinds = {_SCALARS.get(type(a)) for a in args}
        schema: dict[str, Any] = {"enum": list(args)}
        if len(kinds) == 1 and None not in kinds:
            schema["type"] = kinds.pop()
        return schema
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        inner = _schema_of(members[0], where) if len(members) == 1 else {
            "anyOf": [_schema_of(m, where) for m in members]}
        if len(members) == len(args):
            return inner
        kind = inner.get("type")
        if isinstance(kind, str):
            return {**inner, "type": [kind, "null"]}
        return {"anyOf": [inner, {"type": "null"}]}
    if annotation in (list, tuple) or origin in (list, tuple, collections.abc.Sequence):
        if not args:
            return {"type": "array"}
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):  # tuple[int, str]
            return {"type": "array", "prefixItems": [_schema_of(a, where) for a in args],
                    "minItems": len(args), "maxItems": len(args)}
        return {"type": "array", "items": _schema_of(args[0], where)}
    if annotation is dict or origin is dict:
        if args and args[0] is not str:
            raise TypeError(f"{where}: JSON object keys are strings, not {args[0]!r}")
        return {"type": "object", "additionalProperties": _schema_of(args[1], where)} if args else {"type": "object"}
    raise TypeError(f"{where}: no JSON Schema for the annotation {annotation!r}")


_GOOGLE_ARG = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SPHINX_ARG = re.compile(r"^\s*:param\s+(?:[\w\[\], |]+\s+)?(\w+)\s*:\s*(.*)$")
_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?)\s*:\s*$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """``(description, {parameter: description})`` from a Google or Sphinx docstring."""
    text = inspect.cleandoc(doc or "")
    if not text:
        return "", {}
    lines = text.splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line) or line.lstrip().startswith(":"):
            break
        summary.append(line.strip())
    params: dict[str, str] = {}
    section = None
    current = None
    indent = 0
    for line in lines:
        head = _SECTION.match(line)
        if head:
            section, current = head.group(1), None
            continue
        sphinx = _SPHINX_ARG.match(line)
        if sphinx:
            current = sphinx.group(1)
            params[current] = sphinx.group(2).strip()
            indent = len(line) - len(line.lstrip())
            continue
        if section in ("Args", "Arguments", "Parameters"):
            google = _GOOGLE_ARG.match(line)
            here = len(line) - len(line.lstrip())
            if google and (current is None or here <= indent):
                current = google.group(1).lstrip("*")
                params[current] = google.group(2).strip()
                indent = here
                continue
        if current is not None and line.strip() and (len(line) - len(line.lstrip())) > indent:
            params[current] = f"{params[current]} {line.strip()}".strip()
        elif not line.strip():
            current = None if section is None else current
    return " ".join(summary), params


def definition_parts(func: Callable[..., Any]) -> tuple[str, str, dict[str, Any], Callable[[dict[str, Any], Any], Any]]:
    """``(name, description, schema, run)`` for ``Definition``."""
    if not callable(func):
        raise TypeError("from_function takes a function")
    name = getattr(func, "__name__", type(func).__name__)
    signature = inspect.signature(func)
    try:
        hints = typing.get_type_hints(func)
    except Exception as exc:  # a forward reference that does not resolve
        raise TypeError(f"{name}: cannot read its type hints: {exc}") from exc
    description, docs = parse_docstring(inspect.getdoc(func))
    properties: dict[str, Any] = {}
    required: list[str] = []
    wants_context = False
    for pname, param in signature.parameters.items():
        if pname == "context":
            wants_context = True
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"{name}: *{pname} cannot be given by a model; name every parameter")
        if param.kind is param.POSITIONAL_ONLY:
            raise TypeError(f"{name}: {pname} is positional-only; a model names its arguments")
        schema = _schema_of(hints.get(pname, param.annotation), f"{name}({pname})")
        if pname in docs:
            schema["description"] = docs[pname]
        if param.default is inspect.Parameter.empty:
            required.append(pname)
        else:
            try:
                json.dumps(param.default)
                schema["default"] = param.default
            except (TypeError, ValueError):
                pass  # not JSON: left unsaid
        properties[pname] = schema
    parameters: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        parameters["required"] = required

    def run(params: dict[str, Any], context: Any) -> Any:
        value = func(**params, context=context) if wants_context else func(**params)
        if inspect.isawaitable(value):  # an async def: awaited as the approval callback is
            value = await_from_sync(value)
        if isinstance(value, Result):
            return value
        if value is None:
            return Result.success("")
        if isinstance(value, str):
            return Result.success(value)
        return Result.success(json.dumps(value, default=str))

    return name, description, parameters, run
