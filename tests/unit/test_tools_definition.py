"""dispatch.tools.Definition: the seed's Definition tests, then the Python specifics."""

import types

import pytest

from dispatch.tools import Definition, Error, ExecutionError, Result, ValidationError

READ_FILE_SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "description": "File path relative to worktree root"},
        "start_line": {"type": "integer", "description": "Start line (0-based)"},
        "end_line": {"type": "integer", "description": "End line (0-based, -1 for EOF)"},
    },
    "required": ["path"],
}

EDIT_SCHEMA = {
    "type": "object",
    "properties": {
        "edits": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"old_text": {"type": "string"}, "new_text": {"type": "string"}},
                "required": ["old_text", "new_text"],
            },
        }
    },
    "required": ["edits"],
}


def make(func=None, name="read_file", schema=READ_FILE_SCHEMA, **kwargs):
    seen = []

    def record(params, context):
        seen.append((params, context))
        return Result.success(f"read {params['path']}")

    defn = Definition(name, "Read the contents of a file", schema, func or record, **kwargs)
    return defn, seen


# -- the seed's list


def test_creating_a_definition_with_all_attributes():
    def func(params, context):
        return Result.success("")

    defn = Definition("read_file", "Read the contents of a file", READ_FILE_SCHEMA, func,
                      risk="write", advertised=False)
    assert defn.name == "read_file"
    assert defn.description == "Read the contents of a file"
    assert defn.parameters == READ_FILE_SCHEMA
    assert defn.func is func
    assert defn.risk == "write"
    assert defn.advertised is False


def test_risk_defaults_to_execute_fail_closed_and_advertised_to_true():
    defn, _ = make()
    assert (defn.risk, defn.advertised) == ("execute", True)


def test_risk_and_advertised_are_keyword_only():
    with pytest.raises(TypeError):
        Definition("t", "", READ_FILE_SCHEMA, lambda p, c: Result.success(""), "write")


def test_call_executes_the_function_and_returns_its_result():
    defn, seen = make()
    result = defn.call({"path": "src/main.py", "start_line": 0}, context={"worktree": "/w"})
    assert result == Result.success("read src/main.py")
    assert seen == [({"path": "src/main.py", "start_line": 0}, {"worktree": "/w"})]


def test_call_with_a_failing_function_returns_failure_not_an_exception():
    def boom(params, context):
        raise RuntimeError("disk on fire")

    defn, _ = make(boom)
    result = defn.call({"path": "a"})
    assert result == Result.failure("read_file: RuntimeError: disk on fire")


def test_call_with_validation_failure_returns_failure_with_the_errors():
    defn, seen = make()
    result = defn.call({"start_line": "zero"})
    assert result.is_failure
    assert result.error == (
        "read_file: invalid arguments: 'path' is a required property; "
        "$.start_line: 'zero' is not of type 'integer'"
    )
    assert seen == []  # the function never ran


def test_to_dict_produces_the_correct_shape():
    defn, _ = make()
    expected = {
        "name": "read_file",
        "description": "Read the contents of a file",
        "parameters": READ_FILE_SCHEMA,
    }
    assert defn.to_dict() == expected
    assert defn.to_tool_definition() == expected


def test_validate_params_accepts_valid_params():
    defn, _ = make()
    assert defn.validate_params({"path": "a", "start_line": 0, "end_line": -1}) == (True, [])


def test_validate_params_reports_missing_and_mistyped_params():
    defn, _ = make()
    assert defn.validate_params({}) == (False, ["'path' is a required property"])
    assert defn.validate_params({"path": 5}) == (False, ["$.path: 5 is not of type 'string'"])


def test_validate_params_names_nested_paths():
    defn, _ = make(name="edit_file", schema=EDIT_SCHEMA)
    valid, messages = defn.validate_params({"edits": [{"old_text": "a", "new_text": 1}]})
    assert (valid, messages) == (False, ["$.edits[0].new_text: 1 is not of type 'string'"])


def test_validate_params_rejects_what_is_not_an_object():
    defn, _ = make()
    assert defn.validate_params(["a"]) == (False, ["['a'] is not of type 'object'"])
    assert defn.validate_params("a") == (False, ["'a' is not of type 'object'"])


def test_validate_params_takes_none_as_no_arguments():
    defn, _ = make(lambda p, c: Result.success(repr(p)), schema={"type": "object"})
    assert defn.validate_params(None) == (True, [])
    assert defn.call(None) == Result.success("{}")


def test_params_reach_the_function_as_a_plain_str_keyed_dict():
    # The Ruby plan symbolised keys; in Python the keys stay str, the dict is plain.
    defn, seen = make()
    defn.call(types.MappingProxyType({"path": "a"}))
    (params, _), = seen
    assert type(params) is dict and list(params) == ["path"]


def test_validate_params_rejects_non_str_argument_names():
    defn, seen = make(schema={"type": "object"})
    assert defn.validate_params({1: "a"}) == (False, ["argument names must be strings, not 1"])
    assert defn.call({1: "a"}).is_failure
    assert seen == []


def test_params_are_the_functions_own_copy():
    def mutate(params, context):
        params["edits"][0]["old_text"] = "changed"
        params["edits"].append({})
        params["extra"] = True
        return Result.success("ok")

    defn, _ = make(mutate, name="edit_file", schema=EDIT_SCHEMA)
    mine = {"edits": [{"old_text": "a", "new_text": "b"}]}
    assert defn.call(mine).is_success
    assert mine == {"edits": [{"old_text": "a", "new_text": "b"}]}


def test_tuples_in_params_validate_as_arrays():
    defn, _ = make(lambda p, c: Result.success(repr(p)), name="edit_file", schema=EDIT_SCHEMA)
    result = defn.call({"edits": ({"old_text": "a", "new_text": "b"},)})
    assert result.output == "{'edits': [{'old_text': 'a', 'new_text': 'b'}]}"


def test_context_defaults_to_empty_dict_and_is_passed_as_given():
    defn, seen = make()
    defn.call({"path": "a"})
    context = {"worktree": object()}
    defn.call({"path": "a"}, context)
    assert seen[0][1] == {}
    assert seen[1][1] is context


# -- failures from the function


def test_execution_failure_message_is_the_execution_errors():
    exc = ValueError("bad value")
    err = ExecutionError.wrapping("read_file", exc)
    assert isinstance(err, Error)
    assert (str(err), err.tool, err.__cause__) == ("read_file: ValueError: bad value", "read_file", exc)


def test_an_exception_without_a_message_is_named_alone():
    def boom(params, context):
        raise KeyError

    defn, _ = make(boom)
    assert defn.call({"path": "a"}).error == "read_file: KeyError"


def test_an_exception_whose_str_breaks_still_gives_a_failure():
    class Nasty(Exception):
        def __str__(self):
            raise RuntimeError("no str for you")

    def boom(params, context):
        raise Nasty

    defn, _ = make(boom)
    assert defn.call({"path": "a"}) == Result.failure("read_file: Nasty")


def test_a_function_returning_something_else_is_a_failure():
    defn, _ = make(lambda params, context: "just a string")
    assert defn.call({"path": "a"}) == Result.failure(
        "read_file: the tool returned str, not a Result"
    )


def test_a_returned_failure_is_passed_through():
    defn, _ = make(lambda params, context: Result.failure("no such file", {"path": "a"}))
    assert defn.call({"path": "a"}) == Result.failure("no such file", {"path": "a"})


def test_keyboard_interrupt_is_not_swallowed():
    def interrupted(params, context):
        raise KeyboardInterrupt

    defn, _ = make(interrupted)
    with pytest.raises(KeyboardInterrupt):  # a direct call: Ctrl-C stops it as any code
        defn.call({"path": "a"})


def test_system_exit_from_a_tool_is_a_failure():
    def leaving(params, context):
        raise SystemExit(3)

    defn, _ = make(leaving)
    result = defn.call({"path": "a"})
    assert result.is_failure and result.error == f"{defn.name}: SystemExit: 3"


def test_a_huge_offending_value_is_not_read_back_in_full():
    defn, _ = make()
    result = defn.call({"path": ["x" * 10_000]})
    assert result.is_failure
    assert len(result.error) < 400 and result.error.endswith("…")


# -- construction is checked


@pytest.mark.parametrize(
    "name", ["", "has space", "x" * 65, "read_file\n", "a.b", "ünïcode", None, 7]
)
def test_a_bad_name_is_refused(name):
    with pytest.raises(ValidationError, match="tool name"):
        Definition(name, "", {"type": "object"}, lambda p, c: Result.success(""))


@pytest.mark.parametrize("name", ["read_file", "x" * 64, "a-b", "A1", "_"])
def test_a_provider_safe_name_is_accepted(name):
    assert Definition(name, "", {"type": "object"}, lambda p, c: Result.success("")).name == name


def test_an_invalid_schema_is_refused_at_construction():
    with pytest.raises(ValidationError, match="not a valid JSON Schema") as info:
        make(schema={"type": "object", "properties": {"path": {"type": "strung"}}})
    assert isinstance(info.value, ValueError) and isinstance(info.value, Error)


def test_a_schema_that_is_not_an_object_is_refused():
    with pytest.raises(ValidationError, match='"type": "object"'):
        make(schema={"type": "string"})
    with pytest.raises(ValidationError, match="must be a JSON Schema object"):
        make(schema=["type", "object"])


def test_a_bad_risk_description_or_func_is_refused():
    with pytest.raises(ValidationError, match="risk must be one of read, write, execute"):
        make(risk="dangerous")
    with pytest.raises(ValidationError, match="description"):
        Definition("t", None, {"type": "object"}, lambda p, c: Result.success(""))
    with pytest.raises(TypeError, match="callable"):
        Definition("t", "", {"type": "object"}, "not a function")


# -- read-only once built


def test_attributes_are_read_only():
    defn, _ = make()
    for attr in ("name", "description", "parameters", "func", "risk", "advertised"):
        with pytest.raises(AttributeError):
            setattr(defn, attr, None)
    with pytest.raises(AttributeError):
        defn.extra = 1  # __slots__: no new attributes either


def test_the_schema_is_copied_in_and_out():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    defn, _ = make(lambda p, c: Result.success("ok"), schema=schema)
    schema["required"].clear()
    defn.parameters["required"].clear()
    defn.to_dict()["parameters"]["required"].clear()
    assert defn.parameters["required"] == ["n"]
    assert defn.call({}).is_failure  # the validator still wants n


def test_repr_names_the_tool():
    defn, _ = make(risk="execute")
    assert repr(defn) == "Definition(name='read_file', risk='execute', advertised=True)"


def test_twins_made_after_a_call_start_with_the_compiled_check() -> None:
    """A session's registry is made of twins of one checked Definition per
    tool (``_with_func``): the first twin's first call compiles the fast
    check, and twins made after it (the next sessions') start with it."""
    from dispatch._definition import _NOT_COMPILED

    schema = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
              "additionalProperties": False}
    checked = Definition("read_file", "Reads.", schema, lambda params, context: Result.success("unbound"))
    first = checked._with_func(lambda params, context: Result.success("first"))
    before = checked._with_func(lambda params, context: Result.success("before"))
    assert first._fast is _NOT_COMPILED and before._fast is _NOT_COMPILED
    assert first.call({"path": "a"}).output == "first"
    after = checked._with_func(lambda params, context: Result.success("after"))
    assert after._fast is first._fast and after._fast is not _NOT_COMPILED
    assert before._fast is _NOT_COMPILED  # made before: compiles its own on its first call
    assert after.call({"path": "a"}).output == "after"
    bad = after.call({"path": 3})  # the shared check still refuses what it must
    assert not bad.is_success and "path" in (bad.error or "")
