"""A fast yes-check for tool arguments, where it provably agrees with jsonschema.

``Definition.call`` validates every call's arguments against the tool's JSON
Schema with ``jsonschema`` (Draft 2020-12), whose messages are what a model
reads. Its generic machinery costs about 10 µs for a three-property object,
half a bare round trip to the worker. ``fastjsonschema`` compiles a schema to
plain Python and checks the same object in about 1.5 µs, so a call runs this
check first and asks jsonschema only when it says no (for the messages, and
for the final word).

Guarantee: ``fast_check_for(schema)`` returns a check only for schemas written
with the keywords below, on which fastjsonschema's draft-07 and jsonschema's
2020-12 agree, and where fastjsonschema is never the more lenient of the two
(a bool is not an integer in either; enum and const only of strings, where
Python's ``True == 1`` cannot blur them; numeric bounds only beside a
``type``, since fastjsonschema bounds only int, float and Decimal where
jsonschema bounds every ``numbers.Number``, a Fraction say; defaults are not
filled in). For any other schema it returns None and jsonschema alone
decides. What is compiled is a copy without the annotations (``default``,
``examples``...): fastjsonschema would resolve a ``$ref`` found in them,
fetching URLs, and rewrite them in place. The check returns
True only for arguments jsonschema accepts too (tests/unit/test_fastcheck.py
compares the two on every tool schema and a corpus of odd arguments); False
means "ask jsonschema", never "invalid".
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import fastjsonschema

__all__ = ["fast_check_for"]

Check = Callable[[Any], bool]

# Keywords whose value is a schema, a map of schemas, or a plain value.
_SUBSCHEMA = {"items", "additionalProperties"}
_SCHEMA_MAP = {"properties"}
_BOUNDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
# Annotations: no effect on validity, and left out of what is compiled.
_ANNOTATIONS = {"description", "title", "default", "examples", "$comment"}
_PLAIN = {"type", "required", "minLength", "maxLength", "minItems", "maxItems"} | _BOUNDS | _ANNOTATIONS
_TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}

_CHECKS: dict[str, Check | None] = {}
_LOCK = threading.Lock()


def _supported(schema: Any) -> bool:
    if isinstance(schema, bool):
        return True
    if not isinstance(schema, dict):
        return False
    if _BOUNDS & schema.keys() and "type" not in schema:
        return False  # with a type, every fastjsonschema type check refuses a Fraction first
    for key, value in schema.items():
        if key in _SUBSCHEMA:
            # "items" as an array means something else in each draft.
            if not (isinstance(value, (dict, bool)) and _supported(value)):
                return False
        elif key in _SCHEMA_MAP:
            if not (isinstance(value, dict) and all(_supported(v) for v in value.values())):
                return False
        elif key in ("enum", "const"):
            values = value if key == "enum" else [value]
            if not (isinstance(values, list) and all(isinstance(v, str) for v in values)):
                return False
        elif key == "type":
            names = value if isinstance(value, list) else [value]
            if not all(isinstance(n, str) and n in _TYPES for n in names):
                return False
        elif key in _BOUNDS:
            # A bool here is a draft-04 form (or an error) in one library and not the other.
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return False
        elif key not in _PLAIN:
            return False
    return True


def _stripped(schema: Any) -> Any:
    """A copy of a supported schema without its annotations."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key in _SUBSCHEMA:
            value = _stripped(value)
        elif key in _SCHEMA_MAP:
            value = {name: _stripped(sub) for name, sub in value.items()}
        elif isinstance(value, list):
            value = list(value)
        out[key] = value
    return out


def _compile(schema: dict[str, Any]) -> Check | None:
    if not _supported(schema):
        return None
    try:
        # No $ref can be left in the stripped copy (the keyword is not
        # supported, enum and const hold strings only), so building its
        # messages resolves nothing.
        validate = fastjsonschema.compile(_stripped(schema), use_default=False, use_formats=False)
    except Exception:  # noqa: BLE001 (any refusal just means: jsonschema alone)
        return None

    def check(params: Any) -> bool:
        try:
            validate(params)
        except Exception:  # noqa: BLE001 (a refusal, or an odd value the generated code trips on: ask jsonschema)
            return False
        return True

    return check


def fast_check_for(schema: dict[str, Any]) -> Check | None:
    """The compiled check for ``schema`` (made once per distinct schema and
    process: compiling costs 1-3 ms), or None where only jsonschema may judge."""
    key = json.dumps(schema, sort_keys=True, default=repr)
    with _LOCK:
        if key in _CHECKS:
            return _CHECKS[key]
    found = _compile(schema)
    with _LOCK:
        return _CHECKS.setdefault(key, found)
