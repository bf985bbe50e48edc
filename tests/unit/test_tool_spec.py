"""The tool specs: every hand-written JSON Schema agrees with its msgspec struct.

These tests fail when a field is added, renamed, made optional or given a new
default on one side and not the other.
"""

from __future__ import annotations

import subprocess
import sys
import types
import typing
from typing import Any

import jsonschema
import msgspec
import pytest

from dispatchd.policy import ALL_TOOLS, MUTATING_TOOLS, Limits
from dispatchd.tools.base import ToolContext, run_tool
from dispatchd.tools.jobs import Jobs
from dispatchd.catalogue import SPECS, schemas_for
from dispatchd.tools.table import TOOLS

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
               dict: "object"}


def _json_type(annotation: Any) -> str:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _json_type(inner)
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return "object"
    return _JSON_TYPES[typing.get_origin(annotation) or annotation]


def _check_against_struct(schema: dict[str, Any], struct: type[msgspec.Struct], where: str) -> None:
    fields = {f.name: f for f in msgspec.structs.fields(struct)}
    props = schema["properties"]
    assert schema["type"] == "object", where
    assert schema["additionalProperties"] is False, where
    assert list(props) == list(fields), f"{where}: properties differ from {struct.__name__}'s fields"
    assert sorted(schema["required"]) == sorted(n for n, f in fields.items() if f.required), where
    hints = typing.get_type_hints(struct)
    for name, field in fields.items():
        prop = props[name]
        assert prop.get("description", "").strip(), f"{where}.{name} has no description"
        assert prop["type"] == _json_type(hints[name]), f"{where}.{name}: type"
        if "default" in prop:
            assert not field.required and prop["default"] == field.default, f"{where}.{name}: default"
        elif not field.required:
            assert field.default is None, f"{where}.{name}: the default {field.default!r} is not advertised"
        if prop["type"] == "array":
            (item_type,) = typing.get_args(hints[name])
            _check_against_struct(prop["items"], item_type, f"{where}.{name}[]")


def test_every_policy_tool_is_registered() -> None:
    assert list(SPECS) == list(TOOLS) == list(ALL_TOOLS)
    assert all(name == spec.name for name, spec in SPECS.items())
    assert all(tool.spec is SPECS[name] for name, tool in TOOLS.items())


def test_risks_and_slow_tools() -> None:
    # The client reads both from the schemas the daemon sends (approval, MCP
    # hints, which calls Session.cancel tracks): a change here changes those.
    assert {name: spec.risk for name, spec in SPECS.items()} == {
        "read_file": "read", "write_file": "write", "edit_file": "write", "create_file": "write",
        "list_files": "read", "search_files": "read", "shell_exec": "execute", "job_output": "read",
        "job_stop": "execute", "job_list": "read"}
    assert {name for name, spec in SPECS.items() if spec.slow} == {
        "search_files", "shell_exec", "job_output", "job_stop"}
    # Derived in the policy: what a read-only worktree refuses and what takes the write lock.
    assert MUTATING_TOOLS == {"write_file", "edit_file", "create_file", "shell_exec"}


@pytest.mark.process
def test_the_daemon_imports_no_tool_code() -> None:
    # The daemon reads dispatchd/catalogue.py; it must not bring the implementations (or any worker code) along.
    # native.py and the C line loops it loads are not tools: the daemon's status says whether they loaded.
    code = ("import sys, dispatchd.daemon.server, dispatchd.daemon.sessions, dispatchd.policy, dispatchd.protocol; "
            "print(sorted(m for m in sys.modules if m.startswith(('dispatchd.tools.', 'dispatchd.worker'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['dispatchd.tools._lines', 'dispatchd.tools.native']"


@pytest.mark.parametrize("name", ALL_TOOLS)
def test_schema_agrees_with_the_parameter_struct(name: str) -> None:
    spec = SPECS[name]
    _check_against_struct(spec.parameters, spec.params_type, name)


@pytest.mark.parametrize("name", ALL_TOOLS)
def test_schema_is_a_valid_json_schema(name: str) -> None:
    jsonschema.Draft202012Validator.check_schema(SPECS[name].parameters)


@pytest.mark.parametrize("name", ALL_TOOLS)
def test_structs_are_frozen_and_strict(name: str) -> None:
    config = SPECS[name].params_type.__struct_config__
    assert config.frozen and config.forbid_unknown_fields


def test_descriptions_are_written() -> None:
    for spec in SPECS.values():
        assert len(spec.description) > 80, spec.name


def test_contract_field_names() -> None:
    names = {n: [f.name for f in msgspec.structs.fields(t.params_type)] for n, t in SPECS.items()}
    assert names == {
        "read_file": ["path", "start_line", "end_line"],
        "write_file": ["path", "content"],
        "edit_file": ["path", "edits"],
        "create_file": ["path", "content"],
        "list_files": ["path", "pattern", "recursive"],
        "search_files": ["query", "path", "pattern", "is_regex"],
        "shell_exec": ["command", "timeout", "cwd", "background", "env"],
        "job_output": ["job", "offset", "wait"],
        "job_stop": ["job"],
        "job_list": [],
    }


_EXAMPLES = {
    "read_file": {"path": "a.txt", "start_line": 0, "end_line": -1},
    "write_file": {"path": "a.txt", "content": "x"},
    "edit_file": {"path": "a.txt", "edits": [{"old_text": "x", "new_text": "y"}]},
    "create_file": {"path": "b.txt", "content": "x"},
    "list_files": {"path": ".", "pattern": "*.txt", "recursive": False},
    "search_files": {"query": "x", "path": ".", "pattern": "*.txt", "is_regex": True},
    "shell_exec": {"command": "true", "timeout": 1.5, "cwd": ".", "background": False},
    "job_output": {"job": "job_1", "offset": 0, "wait": 0.5},
    "job_stop": {"job": "job_1"},
    "job_list": {},
}


@pytest.mark.parametrize("name", ALL_TOOLS)
def test_full_example_passes_both_the_schema_and_the_struct(name: str) -> None:
    jsonschema.validate(_EXAMPLES[name], SPECS[name].parameters)
    msgspec.convert(_EXAMPLES[name], SPECS[name].params_type)


@pytest.mark.parametrize("name", ALL_TOOLS)
def test_unknown_field_is_refused_by_both(name: str) -> None:
    params = {**_EXAMPLES[name], "bogus": 1}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(params, SPECS[name].parameters)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(params, SPECS[name].params_type)


@pytest.mark.process
def test_examples_run_end_to_end(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("x\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    ctx = ToolContext(root=str(tmp_path.resolve()), limits=Limits(), env={"PATH": "/usr/bin:/bin"},
                      scratch=str(scratch), jobs=Jobs(str(scratch)))
    # The job the job tools' examples name.
    assert run_tool(TOOLS["shell_exec"], ctx, {"command": "echo hi", "background": True}).metadata["job"] == "job_1"
    try:
        for name in ALL_TOOLS:
            r = run_tool(TOOLS[name], ctx, _EXAMPLES[name])
            assert r.success, (name, r.error)
    finally:
        ctx.jobs.close()


def _past_each_bound(schema: dict[str, Any], example: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """For each bound a schema advertises (minimum, exclusiveMinimum,
    minLength, minItems; in array items too): the field's name, and the
    example with that field just outside it."""
    out: list[tuple[str, dict[str, Any]]] = []
    for name, prop in schema["properties"].items():
        if "minimum" in prop:
            out.append((name, {**example, name: prop["minimum"] - 1}))
        if "exclusiveMinimum" in prop:
            out.append((name, {**example, name: prop["exclusiveMinimum"]}))
        if "minLength" in prop:
            out.append((name, {**example, name: "x" * (prop["minLength"] - 1)}))
        if "minItems" in prop:
            out.append((name, {**example, name: example[name][:prop["minItems"] - 1]}))
        if prop["type"] == "array":
            for inner, item in _past_each_bound(prop["items"], example[name][0]):
                out.append((inner, {**example, name: [item, *example[name][1:]]}))
    return out


_PAST_BOUNDS = [(name, field, params) for name in ALL_TOOLS
                for field, params in _past_each_bound(SPECS[name].parameters, _EXAMPLES[name])]


def test_the_bounds_are_found() -> None:
    assert {(name, field) for name, field, _ in _PAST_BOUNDS} == {
        ("read_file", "start_line"), ("read_file", "end_line"), ("edit_file", "edits"), ("edit_file", "old_text"),
        ("search_files", "query"), ("shell_exec", "command"), ("shell_exec", "timeout"), ("job_output", "job"),
        ("job_output", "offset"), ("job_output", "wait"), ("job_stop", "job")}


@pytest.mark.process
@pytest.mark.parametrize(("name", "field", "params"), _PAST_BOUNDS,
                         ids=[f"{name}.{field}" for name, field, _ in _PAST_BOUNDS])
def test_every_bound_the_schema_advertises_the_tool_enforces(name: str, field: str, params: dict[str, Any],
                                                             tmp_path) -> None:
    # The schema is what a model and the client check; the struct does not
    # carry the bounds, so the tool checks them itself, with its own words:
    # a call that skipped the client's check (a raw CallTool) is refused too.
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(params, SPECS[name].parameters)
    (tmp_path / "a.txt").write_text("x\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    ctx = ToolContext(root=str(tmp_path.resolve()), limits=Limits(), env={"PATH": "/usr/bin:/bin"},
                      scratch=str(scratch), jobs=Jobs(str(scratch)))
    try:
        assert run_tool(TOOLS["shell_exec"], ctx, {"command": "sleep 5", "background": True}).metadata["job"] == "job_1"
        # Its twin, the example itself, is accepted (test_examples_run_end_to_end runs each).
        jsonschema.validate(_EXAMPLES[name], SPECS[name].parameters)
        r = run_tool(TOOLS[name], ctx, params)
        assert not r.success and field in (r.error or ""), (params, r.error)
        assert (tmp_path / "a.txt").read_text() == "x\n"
    finally:
        ctx.jobs.close()


def test_wrong_type_is_an_invalid_argument() -> None:
    ctx = ToolContext(root="/nonexistent", limits=Limits(), env={})
    r = run_tool(TOOLS["read_file"], ctx, {"path": "a", "start_line": "3"})
    assert not r.success and r.error.startswith("read_file: invalid arguments: ")


def test_schemas_for_keeps_the_order_and_shape() -> None:
    out = schemas_for(["shell_exec", "read_file"])
    assert [s["name"] for s in out] == ["shell_exec", "read_file"]
    assert all(set(s) == {"name", "description", "parameters", "risk", "slow"} for s in out)
    assert out[1]["parameters"] == SPECS["read_file"].parameters
    assert (out[0]["risk"], out[0]["slow"], out[1]["risk"], out[1]["slow"]) == ("execute", True, "read", False)
    assert schemas_for([]) == []


def test_schemas_for_hands_out_copies() -> None:
    schemas_for(["read_file"])[0]["parameters"]["properties"].clear()
    assert SPECS["read_file"].parameters["properties"]


def test_schemas_for_unknown_tool() -> None:
    with pytest.raises(KeyError, match="no_such_tool"):
        schemas_for(["read_file", "no_such_tool"])
