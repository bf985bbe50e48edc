"""What agent builders meet: strict and Gemini schemas, null for an
optional argument, hidden tools, fail-closed risk, interrupts, ids kept,
deduplicated outputs, async approval, Definition.from_function, and the loop's
Responses provider, stop_loop and parallel reads."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Sequence
from typing import Literal

import jsonschema
import pytest

from dispatch.agent import FakeModel, Trace, run_tool_loop
from dispatch.tools import RETRIEVE_OUTPUT, Definition, OutputStore, Registry, Result

READ = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "start_line": {"type": "integer", "minimum": 0},
        "mode": {"type": "string", "enum": ["a", "b"]},
        "opts": {"type": "object", "properties": {"deep": {"type": "boolean"}}},
    },
    "required": ["path"],
    "additionalProperties": False,
}


def read_tool(seen=None):
    def run(params, context):
        if seen is not None:
            seen.append(params)
        return Result.success(json.dumps(params, sort_keys=True))

    return Definition("read_file", "Read", READ, run, risk="read")


# -- 1. strict shapes


def test_strict_openai_requires_every_property_and_makes_optional_ones_nullable():
    (tool,) = Registry([read_tool()]).schemas("openai", strict=True)
    fn = tool["function"]
    assert fn["strict"] is True
    p = fn["parameters"]
    assert p["required"] == ["path", "start_line", "mode", "opts"] and p["additionalProperties"] is False
    assert p["properties"]["path"] == {"type": "string"}
    assert p["properties"]["start_line"] == {"type": ["integer", "null"], "minimum": 0}
    assert p["properties"]["mode"] == {"type": ["string", "null"], "enum": ["a", "b", None]}
    opts = p["properties"]["opts"]
    assert opts["type"] == ["object", "null"] and opts["required"] == ["deep"]
    assert opts["additionalProperties"] is False and opts["properties"]["deep"] == {"type": ["boolean", "null"]}
    jsonschema.Draft202012Validator.check_schema(p)
    # The tool's own schema is untouched.
    assert Registry([read_tool()]).get("read_file").parameters == READ


def test_openai_responses_always_carries_strict():
    reg = Registry([read_tool()])
    (loose,) = reg.schemas("openai-responses")
    (strict,) = reg.schemas("openai-responses", strict=True)
    assert loose == {"type": "function", "name": "read_file", "description": "Read", "parameters": READ,
                     "strict": False}
    assert strict["strict"] is True and strict["parameters"]["required"] == ["path", "start_line", "mode", "opts"]


def test_strict_is_refused_for_formats_without_it():
    with pytest.raises(ValueError, match="strict=True is for openai and openai-responses, not 'anthropic'"):
        Registry([read_tool()]).schemas("anthropic", strict=True)


def test_null_for_an_optional_argument_means_absent():
    seen = []
    reg = Registry([read_tool(seen)])
    call = {"type": "function_call", "call_id": "c1", "name": "read_file",
            "arguments": json.dumps({"path": "a", "start_line": None, "mode": None, "opts": {"deep": None}})}
    reply = reg.dispatch(call)
    assert reply == {"type": "function_call_output", "call_id": "c1", "output": '{"opts": {}, "path": "a"}'}
    assert seen == [{"path": "a", "opts": {}}]


def test_null_for_a_required_argument_is_still_refused():
    result = Registry([read_tool()]).call("read_file", {"path": None})
    assert result.error == "read_file: invalid arguments: $.path: None is not of type 'string'"


def test_null_stays_where_the_schema_takes_it():
    schema = {"type": "object", "properties": {"x": {"type": ["integer", "null"]}}}
    defn = Definition("t", "", schema, lambda p, c: Result.success(repr(p)), risk="read")
    assert defn.call({"x": None}).output == "{'x': None}"


# -- 9. Gemini


def test_gemini_function_declarations_use_the_openapi_subset():
    schema = {"type": "object", "$schema": "https://json-schema.org/draft/2020-12/schema",
              "properties": {"n": {"type": ["integer", "null"], "default": 3, "description": "how many"},
                             "tags": {"type": "array", "items": {"type": "string"}},
                             "kind": {"enum": ["x", "y"]}},
              "required": ["tags"], "additionalProperties": False}
    reg = Registry([Definition("t", "A tool", schema, lambda p, c: Result.success(""), risk="read")])
    assert reg.schemas("gemini") == [{
        "name": "t", "description": "A tool",
        "parameters": {"type": "object", "required": ["tags"], "properties": {
            "n": {"type": "integer", "nullable": True, "description": "how many"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "kind": {"type": "string", "enum": ["x", "y"]}}},
    }]


# -- 4. hidden tools (and the allowed twin is in test_tools_agent.py)


def test_a_hidden_tool_named_in_a_responses_call_is_unknown_to_the_model():
    hidden = Definition("facts_commit", "", {"type": "object"}, lambda p, c: Result.success("committed"),
                        advertised=False, risk="write")
    reg = Registry([read_tool(), hidden])
    reply = reg.dispatch({"type": "function_call", "call_id": "c", "name": "facts_commit", "arguments": "{}"})
    assert reply["output"] == "Error: Unknown tool: facts_commit. Available tools: read_file"
    assert Registry([read_tool(), hidden], allow_hidden=True).dispatch(
        {"type": "function_call", "call_id": "c", "name": "facts_commit", "arguments": "{}"})["output"] == "committed"


# -- 5. fail closed


def test_a_local_tool_without_a_risk_is_asked_about():
    asked = []
    defn = Definition("mine", "", {"type": "object"}, lambda p, c: Result.success("ran"))
    reg = Registry([defn], approve=lambda d, p, c: asked.append(d.name) or "no")
    assert reg.call("mine", {}).error == "mine: denied by approval: no"
    assert asked == ["mine"]
    read = Definition("mine", "", {"type": "object"}, lambda p, c: Result.success("ran"), risk="read")
    assert Registry([read], approve=lambda d, p, c: "no").call("mine", {}).output == "ran"


# -- 6. interrupts and ids


def test_system_exit_and_keyboard_interrupt_do_not_escape_dispatch():
    def leave(params, context):
        raise SystemExit(1)

    def interrupt(params, context):
        raise KeyboardInterrupt

    reg = Registry([Definition("leave", "", {"type": "object"}, leave, risk="read"),
                    Definition("stop", "", {"type": "object"}, interrupt, risk="read")])
    assert reg.dispatch({"id": "a", "type": "function", "function": {"name": "leave", "arguments": "{}"}}) == {
        "role": "tool", "tool_call_id": "a", "content": "Error: leave: SystemExit: 1"}
    outcome = reg.run_call({"type": "tool_use", "id": "b", "name": "stop", "input": {}})
    assert outcome.reply == {"type": "tool_result", "tool_use_id": "b", "content": "stop: KeyboardInterrupt",
                             "is_error": True}
    assert outcome.result.metadata["interrupted"] is True


@pytest.mark.parametrize(("call", "reply"), [
    ({"call_id": "c7", "name": "read_file"},
     {"type": "function_call_output", "call_id": "c7"}),
    ({"id": "toolu_9", "name": "read_file", "input": {}},
     {"type": "tool_result", "tool_use_id": "toolu_9", "is_error": True}),
    ({"id": "call_5", "name": "read_file"}, {"role": "tool", "tool_call_id": "call_5"}),
])
def test_an_unrecognised_call_keeps_its_id_and_its_shape(call, reply):
    got = Registry([read_tool()]).dispatch(call)
    assert {k: got[k] for k in reply} == reply
    text = got.get("content", got.get("output"))
    assert "unrecognised tool call" in text


def test_a_keyboard_interrupt_stops_the_loop_after_the_turn_is_answered():
    def interrupt(params, context):
        raise KeyboardInterrupt

    reg = Registry([read_tool(), Definition("stop", "", {"type": "object"}, interrupt, risk="write")])
    model = FakeModel([[("stop", {}), ("read_file", {"path": "a"})], "never asked"])
    result = run_tool_loop(model, reg, [])
    assert (result.status, result.iterations, len(model.requests)) == ("interrupted", 1, 1)
    assert [m["tool_call_id"] for m in result.messages[1:]] == ["call_1", "call_2"]


# -- 7. deduplication (seed 003)


def test_the_same_output_twice_is_stored_once():
    store = OutputStore()
    big = "".join(f"line {i}\n" for i in range(500))
    reg = Registry([Definition("echo", "", {"type": "object"}, lambda p, c: Result.success(big), risk="read")],
                   output_budget=400, outputs=store)
    first = reg.run_call({"type": "tool_use", "id": "1", "name": "echo", "input": {}})
    second = reg.run_call({"type": "tool_use", "id": "2", "name": "echo", "input": {}})
    assert first.output_id == second.output_id == "out_1"
    assert len(store) == 1 and store.total_bytes == len(big)
    other = store.put(big + "x")
    assert other == "out_2" and store.put(big) == "out_1" and len(store) == 2
    # out_1 is the newest again: a store of two forgets out_2 first.
    small = OutputStore(max_outputs=2)
    a, b = small.put("a"), small.put("b")
    assert small.put("a") == a
    small.put("c")
    assert a in small and b not in small
    assert reg.call(RETRIEVE_OUTPUT, {"id": "out_1", "end_line": 0}).output.startswith("line 0\n")


# -- 9. async approval


def test_an_async_approval_callback_is_awaited():
    async def approve(definition, params, context):
        await asyncio.sleep(0)
        return True if params.get("ok") else "not ok"

    defn = Definition("w", "", {"type": "object"}, lambda p, c: Result.success("written"), risk="write")
    reg = Registry([defn], approve=approve)
    assert reg.call("w", {"ok": True}).output == "written"
    assert reg.call("w", {}).error == "w: denied by approval: not ok"


def test_an_async_approval_callback_works_from_inside_a_running_loop():
    async def approve(definition, params, context):
        return True

    reg = Registry([Definition("w", "", {"type": "object"}, lambda p, c: Result.success("x"), risk="write")],
                   approve=approve)

    async def main():
        return reg.call("w", {})  # a sync call made from async code

    assert asyncio.run(main()).output == "x"


# -- 9. from_function


def test_from_function_builds_a_schema_from_signature_and_docstring():
    def grep(query: str, paths: list[str], limit: int = 10, mode: Literal["fast", "full"] = "fast",
             case: bool | None = None) -> list[str]:
        """Search files for a text.

        Longer explanation that is not the summary.

        Args:
            query: the text to look for
            paths: where to look,
                relative to the root
            limit: at most this many matches
        """
        return [query, *paths, str(limit), mode, str(case)]

    defn = Definition.from_function(grep, risk="read")
    assert (defn.name, defn.description, defn.risk) == ("grep", "Search files for a text.", "read")
    assert defn.parameters == {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "the text to look for"},
            "paths": {"type": "array", "items": {"type": "string"}, "description": "where to look, relative to the root"},
            "limit": {"type": "integer", "description": "at most this many matches", "default": 10},
            "mode": {"enum": ["fast", "full"], "type": "string", "default": "fast"},
            "case": {"type": ["boolean", "null"], "default": None},
        },
        "required": ["query", "paths"],
        "additionalProperties": False,
    }
    assert defn.call({"query": "q", "paths": ["a"]}).output == '["q", "a", "10", "fast", "None"]'
    assert defn.call({"query": 3, "paths": []}).error == "grep: invalid arguments: $.query: 3 is not of type 'string'"


def test_from_function_reads_sphinx_docstrings_and_passes_context():
    def note(text: str, context=None) -> Result:
        """Write a note.

        :param text: what to write
        """
        return Result.success(f"{text} for {context['user']}")

    defn = Definition.from_function(note)
    assert defn.risk == "execute"  # fail closed unless said
    assert defn.parameters["properties"] == {"text": {"type": "string", "description": "what to write"}}
    assert defn.call({"text": "hi"}, {"user": "ann"}).output == "hi for ann"


def test_from_function_refuses_what_a_model_cannot_give():
    def star(*args: int) -> None: ...

    def odd(x: set) -> None: ...

    with pytest.raises(TypeError, match="star: \\*args cannot be given by a model"):
        Definition.from_function(star)
    with pytest.raises(TypeError, match=r"odd\(x\): no JSON Schema for the annotation"):
        Definition.from_function(odd)


def test_from_function_awaits_an_async_function():
    async def later(n: int) -> int:
        await asyncio.sleep(0)
        return n * 2

    assert Definition.from_function(later, risk="read").call({"n": 21}).output == "42"


# -- 2, 3, 9: the loop


def test_the_loop_speaks_the_responses_api():
    reg = Registry([read_tool()])
    model = FakeModel([[("read_file", {"path": "a"})], "done reading"], provider="openai-responses")
    trace = Trace()
    result = run_tool_loop(model, reg, [{"role": "user", "content": "read a"}], provider="openai-responses",
                           trace=trace)
    assert result.status == "done" and result.final == "done reading"
    assert result.messages == [
        {"role": "user", "content": "read a"},
        {"type": "function_call", "call_id": "fc_1", "name": "read_file", "arguments": '{"path": "a"}'},
        {"type": "function_call_output", "call_id": "fc_1", "output": '{"path": "a"}'},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done reading"}]},
    ]
    assert model.requests[0][1] == reg.schemas("openai-responses")
    assert trace[0].content == '{"path": "a"}'


def test_the_loop_takes_a_responses_object_with_output():
    class Response:
        def __init__(self, output):
            self.output = output

    replies = iter([
        Response([{"type": "reasoning", "id": "r1", "summary": []},
                  {"type": "function_call", "call_id": "x", "name": "read_file", "arguments": '{"path": "b"}'}]),
        Response([{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}]),
    ])
    result = run_tool_loop(lambda m, t: next(replies), Registry([read_tool()]), [], provider="openai-responses")
    assert result.final == "ok"
    assert [m["type"] for m in result.messages] == ["reasoning", "function_call", "function_call_output", "message"]


@pytest.mark.parametrize("provider", ["openai", "openai-responses", "anthropic"])
def test_stop_loop_ends_the_loop_after_the_turn(provider):
    finish = Definition("finish", "", {"type": "object"},
                        lambda p, c: Result.success("task complete", {"stop_loop": True}), risk="read")
    reg = Registry([read_tool(), finish])
    model = FakeModel([[("finish", {}), ("read_file", {"path": "a"})], "never asked"], provider=provider)
    result = run_tool_loop(model, reg, [], provider=provider)
    assert (result.status, result.final, result.iterations, len(model.requests)) == (
        "stopped", "task complete", 1, 1)
    assert not result.done


def test_read_calls_of_a_turn_run_in_parallel_and_answer_in_order():
    inside = []
    both = threading.Barrier(3, timeout=5)

    def slow(params, context):
        inside.append(params["path"])
        both.wait()  # three at once or a BrokenBarrierError
        return Result.success(params["path"])

    order = []
    schema = {"type": "object", "properties": {"path": {"type": "string"}}}
    reg = Registry([Definition("read_file", "", schema, slow, risk="read"),
                    Definition("write_file", "", schema, lambda p, c: order.append(list(inside)) or Result.success("w"),
                               risk="write")])
    model = FakeModel([[("read_file", {"path": "a"}), ("read_file", {"path": "b"}), ("read_file", {"path": "c"}),
                        ("write_file", {"path": "d"})], "ok"])
    result = run_tool_loop(model, reg, [])
    assert [m["content"] for m in result.messages[1:5]] == ["a", "b", "c", "w"]
    assert sorted(order[0]) == ["a", "b", "c"]  # the write waited for the reads


def test_parallel_reads_can_be_turned_off():
    running = []
    peak = []

    def read(params, context):
        running.append(1)
        peak.append(len(running))
        time.sleep(0.01)
        running.pop()
        return Result.success("r")

    reg = Registry([Definition("read_file", "", {"type": "object"}, read, risk="read")])
    run_tool_loop(FakeModel([[("read_file", {})] * 3, "ok"]), reg, [], parallel_reads=1)
    assert max(peak) == 1


def test_strict_shapes_keep_only_the_keywords_openai_documents():
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "default": "x", "description": "d"},
        "n": {"type": "integer", "minimum": 0, "default": 0}}, "required": ["name"]}
    reg = Registry([Definition("t", "", schema, lambda p, c: Result.success(repr(p)), risk="read")])
    (tool,) = reg.schemas("openai", strict=True)
    assert tool["function"]["parameters"]["properties"] == {
        "name": {"type": "string", "description": "d"}, "n": {"type": ["integer", "null"], "minimum": 0}}
    # What was left out of the shape is still checked.
    assert reg.call("t", {"name": ""}).error == "t: invalid arguments: $.name: '' should be non-empty"


def test_from_function_sequences_and_mappings():
    def f(a: Sequence[int], b: tuple[int, str], c: tuple[float, ...], d: dict[str, bool]) -> None:
        """F."""

    props = Definition.from_function(f).parameters["properties"]
    assert props["a"] == {"type": "array", "items": {"type": "integer"}}
    assert props["b"] == {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                          "minItems": 2, "maxItems": 2}
    assert props["c"] == {"type": "array", "items": {"type": "number"}}
    assert props["d"] == {"type": "object", "additionalProperties": {"type": "boolean"}}
