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

__all__ = ["fast_check_for", "is_flat"]

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
_FLAT: set[Check] = set()  # the checks _flat wrote out (see is_flat)
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


# The scalar property types of a flat schema, by exact type: a bool is no
# integer, and 2.0 (an integer to jsonschema) or a str subclass is left to it.
_FLAT_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                            "boolean": (bool,)}
_FLAT_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties"}


def _flat(schema: dict[str, Any]) -> Check | None:
    """A check written out for the usual tool schema (every tool but
    edit_file): an object with no property but those listed, each a single
    scalar type with bounds, lengths or a string enum; None for any other
    schema. It walks the arguments once, where fastjsonschema's generated code
    builds two sets a call. Stricter than jsonschema where they could differ
    (exact types), never more lenient: each test below is the negation of
    jsonschema's error condition for that keyword."""
    if (schema.keys() - _FLAT_OBJECT_KEYS or schema.get("type") != "object"
            or schema.get("additionalProperties") is not False):
        return None
    properties, required = schema.get("properties", {}), schema.get("required", [])
    if not isinstance(properties, dict) or not isinstance(required, list) \
            or not all(isinstance(r, str) for r in required):
        return None
    rules: dict[str, tuple[tuple[type, ...], list[Callable[[Any], bool]]]] = {}
    for name, prop in properties.items():
        if not isinstance(prop, dict) or not isinstance(prop.get("type"), str) or prop["type"] not in _FLAT_TYPES:
            return None
        kind = prop["type"]
        tests = []
        for key, bound in prop.items():
            if key == "type":
                continue
            test = _value_test(kind, key, bound)
            if test is None:
                return None
            tests.append(test)
        rules[name] = (_FLAT_TYPES[kind], tests)
    needed = tuple(required)

    def check(params: Any) -> bool:
        if type(params) is not dict:
            return False
        for name in needed:
            if name not in params:
                return False
        for name, value in params.items():
            rule = rules.get(name)  # a name not listed (a non-str key too): additionalProperties is false
            if rule is None or type(value) not in rule[0]:
                return False
            for test in rule[1]:
                if not test(value):
                    return False
        return True

    return check


def _value_test(kind: str, key: str, bound: Any) -> Callable[[Any], bool] | None:
    """The test of one keyword of a flat property, for a value of its type
    (each the negation of jsonschema's error condition); None where the
    flat check does not write it out."""
    if key in _BOUNDS and kind in ("integer", "number"):  # _supported: an int or float, not a bool
        if key == "minimum":
            return lambda v: v >= bound
        if key == "maximum":
            return lambda v: v <= bound
        if key == "exclusiveMinimum":
            return lambda v: v > bound
        return lambda v: v < bound  # exclusiveMaximum
    if key in ("minLength", "maxLength") and kind == "string" and type(bound) is int:
        if key == "minLength":
            return lambda v: len(v) >= bound
        return lambda v: len(v) <= bound
    if key == "enum" and kind == "string":  # _supported: a list of strings
        allowed = frozenset(bound)
        return lambda v: v in allowed
    return None


def _compile(schema: dict[str, Any]) -> Check | None:
    if not _supported(schema):
        return None
    flat = _flat(_stripped(schema))
    if flat is not None:
        with _LOCK:
            _FLAT.add(flat)
        return flat
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


def is_flat(check: Check) -> bool:
    """Whether ``check`` is a flat schema's (``_flat``): it says yes only to a
    dict whose every value is an exact str, int, float or bool, so a shallow
    copy of what it accepted is a plain copy with no null to drop, and the
    caller can skip both walks (``Definition._arguments``)."""
    return check in _FLAT
