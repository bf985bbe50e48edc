"""JSON Schemas rewritten for what a model provider accepts, as pure functions.

The shapes that wrap a tool for each provider are in ``_providers``; this
module only rewrites a tool's ``parameters``.

Guarantees:
- no function changes what it is given: the tool's own schema stays as it was;
- ``strict_schema`` is what OpenAI's strict mode accepts: every object lists
  all its properties in ``required`` and has ``additionalProperties: false``,
  and only the keywords it documents are kept;
  a property that was optional accepts ``null`` as well, which
  ``Definition.call`` reads as "not given" (see ``drop_null_optionals``);
- ``gemini_schema`` keeps only the OpenAPI 3.0 subset Gemini's function
  declarations take (no ``additionalProperties``, ``$schema``, ``default``…;
  ``["T", "null"]`` becomes ``T`` with ``nullable: true``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


# ---------------------------------------------------------------- strict mode (OpenAI)


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` also accepting null."""
    kind = schema.get("type")
    if isinstance(kind, str) and kind != "null":
        schema = {**schema, "type": [kind, "null"]}
    elif isinstance(kind, list) and "null" not in kind:
        schema = {**schema, "type": [*kind, "null"]}
    elif kind is None:
        return {"anyOf": [schema, {"type": "null"}]}
    if "enum" in schema and None not in schema["enum"]:
        schema["enum"] = [*schema["enum"], None]
    return schema


# The keywords OpenAI documents for strict mode. Others (``default``,
# ``minLength``...) are left out of what a model is shown; the tool's own
# schema, which ``Definition.call`` checks, still holds them.
_STRICT_KEYS = frozenset({
    "type", "properties", "required", "additionalProperties", "enum", "const", "anyOf", "$ref", "$defs",
    "definitions", "items", "description", "title", "pattern", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems", "maxItems",
})


def strict_schema(schema: Any) -> Any:
    """``schema`` rewritten for strict mode (recursively: nested objects, items, anyOf)."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: strict_schema(v) if k in ("items", "anyOf") else v
           for k, v in schema.items() if k in _STRICT_KEYS}
    for defs in ("$defs", "definitions"):
        if isinstance(schema.get(defs), Mapping):
            out[defs] = {k: strict_schema(v) for k, v in schema[defs].items()}
    props = schema.get("properties")
    if isinstance(props, Mapping):
        required = set(schema.get("required") or ())
        out["properties"] = {
            name: strict_schema(sub) if name in required else _nullable(strict_schema(sub))
            for name, sub in props.items()
        }
        out["required"] = list(props)
        out["additionalProperties"] = False
    elif out.get("type") == "object":
        out["additionalProperties"] = False
        out.setdefault("properties", {})
        out["required"] = []
    return out


def drop_null_optionals(schema: Mapping[str, Any], args: Any) -> Any:
    """``args`` without the ``None`` of optional properties that do not take null
    themselves: a strict-mode model must send every property, and sends null
    for one it means to leave out. Nested objects are read the same way."""
    if not isinstance(args, dict):
        return args
    props = schema.get("properties")
    if not isinstance(props, Mapping):
        return args
    required = set(schema.get("required") or ())
    out = {}
    for key, value in args.items():
        sub = props.get(key)
        if value is None and key not in required and isinstance(sub, Mapping) and not _takes_null(sub):
            continue
        out[key] = drop_null_optionals(sub, value) if isinstance(sub, Mapping) else value
    return out


def _takes_null(schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return True
    if None in (schema.get("enum") or ()):
        return True
    return any(isinstance(s, Mapping) and _takes_null(s) for s in schema.get("anyOf") or ())


# ---------------------------------------------------------------- Gemini (OpenAPI 3.0 subset)

_GEMINI_KEYS = ("type", "format", "description", "nullable", "enum", "items", "properties", "required",
                "minimum", "maximum", "minItems", "maxItems", "minLength", "maxLength", "pattern",
                "anyOf", "title")


def gemini_schema(schema: Any) -> Any:
    """``schema`` in the OpenAPI 3.0 subset of Gemini's ``FunctionDeclaration.parameters``."""
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key in _GEMINI_KEYS:
        if key not in schema:
            continue
        value = schema[key]
        if key == "type" and isinstance(value, list):
            kinds = [k for k in value if k != "null"]
            if len(kinds) != len(value):
                out["nullable"] = True
            if len(kinds) == 1:
                value = kinds[0]
            else:  # several types: Gemini wants anyOf
                out["anyOf"] = [{"type": k} for k in kinds]
                continue
        elif key == "items":
            value = gemini_schema(value)
        elif key == "anyOf":
            value = [gemini_schema(v) for v in value]
        elif key == "properties":
            value = {name: gemini_schema(sub) for name, sub in value.items()}
        elif key == "enum":
            if None in value:
                out["nullable"] = True
            value = [str(v) for v in value if v is not None]  # Gemini's enums are strings
            if not out.get("type") and "type" not in schema:
                out["type"] = "string"
        out[key] = value
    return out
