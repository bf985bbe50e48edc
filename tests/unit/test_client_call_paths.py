"""The registry's call without an approval to ask takes ``Definition.call``'s
path: the same Result as the general path (validation, then the function)
for every input, good or bad, with the same message word for word.

The reference is the general path itself, ``_arguments`` then ``_invoke``,
which ``Registry.call`` still takes when an approval is asked.
"""

from __future__ import annotations

from typing import Any

import pytest

from dispatch.tools import Definition, Registry, Result

FLAT = {  # read_file's shape: the flat fast check applies
    "type": "object",
    "properties": {"path": {"type": "string", "minLength": 1},
                   "start_line": {"type": "integer", "minimum": 0},
                   "mode": {"type": "string", "enum": ["a", "b"]}},
    "required": ["path"],
    "additionalProperties": False,
}
NESTED = {  # edit_file's kind: no flat check, jsonschema (and fastjsonschema) judge
    "type": "object",
    "properties": {"edits": {"type": "array", "items": {"type": "object",
                                                        "properties": {"old": {"type": "string"}},
                                                        "required": ["old"]}},
                   "note": {"type": "string"}},
    "required": ["edits"],
}

INPUTS: list[Any] = [
    {"path": "a.txt"},
    {"path": "a.txt", "start_line": 3, "mode": "a"},
    {},
    {"path": ""},
    {"path": 7},
    {"path": "a", "start_line": -1},
    {"path": "a", "start_line": True},
    {"path": "a", "start_line": 2.0},
    {"path": "a", "mode": "c"},
    {"path": "a", "extra": 1},
    {"path": "a", "start_line": None},
    {1: "x"},
    None,
    [],
    "path",
    {"edits": [{"old": "x"}]},
    {"edits": [{"new": "x"}]},
    {"edits": "no"},
    {"edits": [], "note": None},
]


def _echo(params: dict[str, Any], context: Any) -> Result:
    return Result.success(repr(sorted(params.items(), key=repr)), {"context": repr(context)})


def _raises(params: dict[str, Any], context: Any) -> Result:
    raise RuntimeError("boom")


def _exits(params: dict[str, Any], context: Any) -> Result:
    raise SystemExit(3)


def _not_a_result(params: dict[str, Any], context: Any) -> Result:
    return "text"  # type: ignore[return-value]


def _general(defn: Definition, params: Any, context: Any = None) -> Result:
    """The general path: validate, then run."""
    args, failure = defn._arguments(params)
    if args is None:
        assert failure is not None
        return failure
    return defn._invoke(args, context)


@pytest.mark.parametrize("schema", [FLAT, NESTED], ids=["flat", "nested"])
@pytest.mark.parametrize("func", [_echo, _raises, _exits, _not_a_result])
@pytest.mark.parametrize("risk", ["read", "execute"])
def test_registry_call_gives_the_general_paths_result(schema: dict[str, Any], func: Any, risk: str) -> None:
    defn = Definition("tool", "a tool", schema, func, risk=risk)
    registry = Registry([defn])
    for params in INPUTS:
        for context in (None, {"k": 1}):
            expected = _general(defn, params, context)
            assert registry.call("tool", params, context) == expected, params
            assert defn.call(params, context) == expected, params


def test_the_same_bad_input_gives_the_same_message_on_every_path() -> None:
    defn = Definition("read_file", "reads", FLAT, _echo, risk="read")
    registry = Registry([defn])
    asked = Registry([defn], approve=lambda d, p, c: True)
    bad = {"path": 7, "extra": 1}
    message = ("read_file: invalid arguments: Additional properties are not allowed ('extra' was unexpected); "
               "$.path: 7 is not of type 'string'")
    for result in (registry.call("read_file", bad), defn.call(bad), asked.call("read_file", bad), _general(defn, bad)):
        assert result.is_failure and result.error == message
    # The allowed twin: the same call with good arguments runs on every path.
    good = {"path": "a.txt"}
    for result in (registry.call("read_file", good), defn.call(good), asked.call("read_file", good)):
        assert result.is_success and result.output == "[('path', 'a.txt')]"


def test_an_approval_is_still_asked_where_the_risk_needs_it() -> None:
    asked: list[tuple[str, dict[str, Any]]] = []

    def approve(d: Definition, params: dict[str, Any], context: Any) -> bool | str:
        asked.append((d.name, params))
        return "not now" if d.name == "writer" else True

    registry = Registry([Definition("writer", "writes", FLAT, _echo, risk="write"),
                         Definition("runner", "runs", FLAT, _echo, risk="execute"),
                         Definition("reader", "reads", FLAT, _echo, risk="read")], approve=approve)
    denied = registry.call("writer", {"path": "a"})
    assert denied.is_failure and denied.error == "writer: denied by approval: not now"
    assert dict(denied.metadata) == {"denied": True, "reason": "not now"}
    ran = registry.call("runner", {"path": "a"})  # the allowed twin
    assert ran.is_success
    assert registry.call("reader", {"path": "a"}).is_success  # read: nobody asked
    assert asked == [("writer", {"path": "a"}), ("runner", {"path": "a"})]
    # Invalid arguments are refused before anyone is asked.
    assert registry.call("writer", {"path": 1}).error == "writer: invalid arguments: $.path: 1 is not of type 'string'"
    assert len(asked) == 2


def test_the_function_gets_its_own_copy_of_the_arguments() -> None:
    seen: list[dict[str, Any]] = []

    def keep(params: dict[str, Any], context: Any) -> Result:
        seen.append(params)
        params["path"] = "changed"
        return Result.success("ok")

    registry = Registry([Definition("t", "t", FLAT, keep, risk="read")])
    mine = {"path": "a"}
    assert registry.call("t", mine).is_success
    assert mine == {"path": "a"} and seen[0] is not mine
