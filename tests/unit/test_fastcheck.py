"""The fast argument check never says yes where jsonschema says no.

``dispatch._fastcheck`` may only speed up the common, valid call: every
"valid" it gives must be jsonschema's "valid" too. These tests compare the two
on every tool schema the worker advertises and on schemas with the keywords
the check accepts, over a corpus of ordinary and odd arguments (bools where
integers belong, floats, None, nested junk, extra and missing keys).
"""

from __future__ import annotations

import copy
import itertools
import time
from fractions import Fraction
from typing import Any

import jsonschema
import pytest

from dispatch import Definition, Result
from dispatch.tools import ValidationError
from dispatch._fastcheck import fast_check_for
from dispatchd.catalogue import SPECS

_VALUES: list[Any] = [
    None, True, False, 0, 1, -1, -2, 2, 1.0, 1.5, -1.0, 0.0, 10**30, float("inf"),
    "", "x", "src/main.py", "..", "\x00", "é", [], [""], ["a", "b"], [1], [{}],
    [{"old_text": "a", "new_text": "b"}], [{"old_text": "", "new_text": "b"}],
    [{"old_text": "a"}], [{"old_text": "a", "new_text": "b", "x": 1}], [{"old_text": True, "new_text": "b"}],
    {}, {"a": 1}, ("t",),
]


def _corpus(schema: dict[str, Any]) -> list[Any]:
    """Argument objects for ``schema``: each property given each value, pairs
    of them, nothing, an unknown key, and non-objects."""
    names = list(schema.get("properties", {})) + ["unknown"]
    base = {n: "x" for n in schema.get("required", [])}
    out: list[Any] = [None, [], "x", 1, True, {}, dict(base)]
    for name, value in itertools.product(names, _VALUES):
        out.append({**base, name: value})
    for (a, va), (b, vb) in itertools.combinations(itertools.product(names[:3], _VALUES[:16]), 2):
        if a != b:
            out.append({**base, a: va, b: vb})
    return out


def _agrees(schema: dict[str, Any]) -> int:
    """Assert fast "yes" implies jsonschema "yes"; return how many yeses."""
    check = fast_check_for(schema)
    assert check is not None, f"no fast check for {schema}"
    validator = jsonschema.Draft202012Validator(schema)
    yes = 0
    for params in _corpus(schema):
        fast = check(params)
        if fast:
            yes += 1
            assert validator.is_valid(params), f"fast check accepted {params!r}, jsonschema does not"
    return yes


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_tool_schema_agrees_with_jsonschema(name: str) -> None:
    # and the fast path is really used: valid calls are accepted by it
    assert _agrees(SPECS[name].parameters) > 0


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 5}}},
    {"type": "object", "properties": {"n": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 2}}},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 3}}},
    {"type": "object", "properties": {"s": {"enum": ["x", "src/main.py"]}}},
    {"type": "object", "properties": {"s": {"const": "x"}}},
    {"type": "object", "properties": {"s": {"type": ["string", "null"]}}},
    {"type": "object", "properties": {"b": {"type": "boolean"}}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}, "maxItems": 1}}},
    {"type": "object", "properties": {"a": True, "b": False}},
    # flat (the hand-written check, dispatch._fastcheck._flat): no other property allowed
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 5}},
     "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 2}},
     "required": ["n"], "additionalProperties": False},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 3}},
     "additionalProperties": False},
    {"type": "object", "properties": {"s": {"type": "string", "enum": ["x", "src/main.py"]},
                                      "b": {"type": "boolean"}}, "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "number", "minimum": 0.5}}, "additionalProperties": False},
])
def test_supported_keywords_agree_with_jsonschema(schema: dict[str, Any]) -> None:
    _agrees(schema)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"n": {"enum": [1, 2]}}},  # True == 1 in Python
    {"type": "object", "properties": {"n": {"const": 1}}},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a$"}}},
    {"type": "object", "properties": {"s": {"type": "string", "format": "email"}}},
    {"type": "object", "properties": {"a": {"type": "array", "prefixItems": [{"type": "string"}]}}},
    {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}]}}},
    {"type": "object", "$defs": {"x": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/x"}}},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": True}}},
    {"type": "object", "properties": {"a": {"type": "array", "items": [{"type": "string"}]}}},
    {"type": "object", "unevaluatedProperties": False},
])
def test_other_keywords_leave_the_decision_to_jsonschema(schema: dict[str, Any]) -> None:
    assert fast_check_for(schema) is None


def test_defaults_are_not_filled_in() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "default": 3}}}
    seen: list[dict[str, Any]] = []
    tool = Definition("t", "d", schema, lambda args, ctx: (seen.append(args), Result.success("ok"))[1])
    assert tool.call({}).is_success
    assert seen == [{}]


def test_a_refusal_still_carries_jsonschemas_message() -> None:
    tool = Definition("read_file", "d", SPECS["read_file"].parameters, lambda a, c: Result.success("ok"))
    result = tool.call({"path": "a", "start_line": True})
    assert result.is_failure
    assert result.error == "read_file: invalid arguments: $.start_line: True is not of type 'integer'"
    # and a value the fast check refuses but jsonschema accepts still runs
    assert tool.call({"path": "a", "start_line": 2.0}).is_success


def test_bounds_without_a_type_are_left_to_jsonschema() -> None:
    # fastjsonschema bounds int, float and Decimal; jsonschema every
    # numbers.Number: a Fraction over the maximum would pass the fast check.
    assert fast_check_for({"type": "object", "properties": {"n": {"maximum": 10}}}) is None
    check = fast_check_for({"type": "object", "properties": {"n": {"type": "number", "maximum": 10}}})
    assert check is not None and check({"n": Fraction(100, 1)}) is False
    tool = Definition("t", "d", {"type": "object", "properties": {"n": {"maximum": 10}}},
                      lambda a, c: Result.success("ran"))
    assert tool.call({"n": Fraction(100, 1)}).error == \
        "t: invalid arguments: $.n: Fraction(100, 1) is greater than the maximum of 10"


def test_annotations_are_neither_fetched_nor_rewritten() -> None:
    # A $ref in an annotation: fastjsonschema would resolve it (fetching the
    # URL) and rewrite it in place; the compiled copy has no annotations.
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "examples": [{"$ref": "http://127.0.0.1:9/never"}],
              "default": {"$ref": "http://127.0.0.1:9/x.json"}}}}
    before = copy.deepcopy(schema)
    assert fast_check_for(copy.deepcopy(schema)) is not None  # the fast check is used here
    started = time.monotonic()
    tool = Definition("t", "d", schema, lambda a, c: Result.success("ran"))
    assert tool.call({"a": "x"}).is_success and tool.call({"a": 1}).is_failure
    assert time.monotonic() - started < 2
    assert tool.to_dict()["parameters"] == before


def test_a_schema_key_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(ValidationError, match="t: parameters must be JSON: the key 1 is not a string"):
        Definition("t", "d", {"type": "object", "properties": {1: {"type": "integer"}}}, lambda a, c: Result.success("x"))


def test_the_usual_tool_schema_gets_the_flat_check() -> None:
    from dispatch._fastcheck import _flat, _stripped

    flat = [name for name, spec in SPECS.items() if _flat(_stripped(spec.parameters)) is not None]
    assert "read_file" in flat
    # shell_exec's env is an object of strings: the compiled check, not the flat one
    assert "shell_exec" not in flat and fast_check_for(SPECS["shell_exec"].parameters) is not None
    assert "edit_file" not in flat  # an array of objects: fastjsonschema's
    check = fast_check_for(SPECS["read_file"].parameters)
    assert check is not None
    assert check({"path": "a", "start_line": 0}) and not check({"path": "a", "start_line": True})
    assert not check({"path": "a", 1: "b"}) and not check({"start_line": 0}) and not check(["path"])
