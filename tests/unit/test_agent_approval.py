"""Registry approval: write and execute tools ask a callback first; a denial is
a failure with a reason (seed 004: reads auto-approved, writes and shell need
approval, a denial reaches the model as an error it can answer)."""

import pytest

from dispatch.tools import Definition, Registry, Result

WRITTEN: list[dict] = []


def write(params, context):
    WRITTEN.append(params)
    return Result.success(f"wrote {params['path']}")


PATH = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


@pytest.fixture(autouse=True)
def _clear():
    WRITTEN.clear()


def tools(approve=None):
    return Registry(
        [
            Definition("read_file", "Read", PATH, lambda p, c: Result.success("contents"), risk="read"),
            Definition("write_file", "Write", PATH, write, risk="write"),
            Definition("shell_exec", "Run", {"type": "object"}, lambda p, c: Result.success("ran"),
                       risk="execute"),
        ],
        approve=approve,
    )


class Asked:
    def __init__(self, answer):
        self.answer = answer
        self.calls = []

    def __call__(self, definition, params, context):
        self.calls.append((definition.name, params, context))
        return self.answer(definition, params) if callable(self.answer) else self.answer


def test_reads_are_not_asked_about():
    asked = Asked(False)
    assert tools(asked).call("read_file", {"path": "a"}).output == "contents"
    assert asked.calls == []


@pytest.mark.parametrize("name, params", [("write_file", {"path": "a"}), ("shell_exec", {})])
def test_writes_and_execution_are_asked_about_with_the_params_and_context(name, params):
    asked = Asked(True)
    assert tools(asked).call(name, params, {"user": "ann"}).is_success
    assert asked.calls == [(name, params, {"user": "ann"})]


def test_a_denial_with_a_reason():
    result = tools(Asked("not on a Friday")).call("write_file", {"path": "a"})
    assert result == Result.failure("write_file: denied by approval: not on a Friday",
                                    {"denied": True, "reason": "not on a Friday"})
    assert WRITTEN == []


def test_a_denial_without_a_reason():
    result = tools(Asked(False)).call("write_file", {"path": "a"})
    assert result.error == "write_file: denied by approval"
    assert result.metadata == {"denied": True, "reason": ""}


@pytest.mark.parametrize("answer", [None, 1, "yes"[:0], [], "  "])
def test_only_true_approves(answer):
    result = tools(Asked(answer)).call("write_file", {"path": "a"})
    assert result.is_failure and result.metadata["denied"] is True
    assert WRITTEN == []


def test_a_callback_that_raises_denies():
    def broken(definition, params, context):
        raise RuntimeError("prompt closed")

    result = tools(broken).call("shell_exec", {})
    assert result.error == ("shell_exec: denied by approval: the approval callback failed: "
                            "RuntimeError: prompt closed")


def test_invalid_arguments_and_unknown_tools_are_not_asked_about():
    asked = Asked(True)
    registry = tools(asked)
    assert registry.call("write_file", {"path": 3}).error.startswith("write_file: invalid arguments:")
    assert registry.call("rm_rf", {}).error.startswith("Unknown tool: rm_rf.")
    assert asked.calls == []


def test_the_callback_cannot_change_what_runs():
    def meddle(definition, params, context):
        params["path"] = "/etc/passwd"
        return True

    assert tools(meddle).call("write_file", {"path": "a"}).output == "wrote a"
    assert WRITTEN == [{"path": "a"}]


def test_a_callback_can_decide_on_the_arguments():
    registry = tools(Asked(lambda d, p: True if p["path"].startswith("src/") else "only src/ may change"))
    assert registry.call("write_file", {"path": "src/x"}).is_success
    assert registry.call("write_file", {"path": "setup.py"}).error == (
        "write_file: denied by approval: only src/ may change")


def test_dispatch_asks_too_and_the_model_reads_the_reason():
    registry = tools(Asked("ask the user first"))
    openai = {"id": "c1", "type": "function", "function": {"name": "write_file", "arguments": '{"path": "a"}'}}
    assert registry.dispatch(openai) == {
        "role": "tool", "tool_call_id": "c1",
        "content": "Error: write_file: denied by approval: ask the user first",
    }
    anthropic = {"type": "tool_use", "id": "t1", "name": "shell_exec", "input": {}}
    reply = registry.dispatch(anthropic)
    assert (reply["is_error"], reply["content"]) == (True, "shell_exec: denied by approval: ask the user first")
    outcome = registry.run_call(anthropic)
    assert outcome.result.metadata["denied"] is True
    assert WRITTEN == []


def test_with_approval_makes_a_new_registry_with_the_same_tools():
    plain = tools()
    gated = plain.with_approval(Asked(False))
    assert gated is not plain and gated.approve is not None and plain.approve is None
    assert gated.tools == plain.tools  # the very same definitions
    assert plain.call("write_file", {"path": "a"}).is_success
    assert gated.call("write_file", {"path": "a"}).is_failure
    assert gated.with_approval(None).call("write_file", {"path": "b"}).is_success


def test_subset_keeps_the_approval():
    sub = tools(Asked(False)).subset("write_file")
    assert sub.tool_names == ["write_file"]
    assert sub.call("write_file", {"path": "a"}).metadata["denied"] is True


def test_definition_call_asks_no_one():
    # The registry is the gate; a Definition run by hand is the caller's decision.
    registry = tools(Asked(False))
    assert registry.get("write_file").call({"path": "a"}).is_success


def test_approve_must_be_callable():
    with pytest.raises(TypeError, match="approve must be callable"):
        Registry(approve="yes")
