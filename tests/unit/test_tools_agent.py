"""dispatch.tools agent integration: schemas(), call() and dispatch() for each provider."""

import json
import types

import pytest

from dispatch.tools import Definition, Registry, Result

GREP = {
    "name": "search_files",
    "description": "Search the worktree",
    "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"],
    },
}


def search(params, context):
    if params["query"] == "explode":
        raise OSError("index gone")
    return Result.success(f"found {params['query']} in {context.get('root', '?')}")


@pytest.fixture
def registry():
    return (
        Registry()
        .register(Definition(**GREP, func=search))
        .register(Definition("ping", "Answer pong", {"type": "object"},
                             lambda p, c: Result.success("pong")))
        .register(Definition("facts_commit", "Commit facts", {"type": "object"},
                             lambda p, c: Result.success("committed"), advertised=False))
    )


def openai(name, arguments, id="call_1"):
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def anthropic(name, input, id="toolu_1"):
    return {"type": "tool_use", "id": id, "name": name, "input": input}


# -- schemas


def test_schemas_plain_is_to_list(registry):
    assert registry.schemas() == registry.to_list() == [GREP, registry.get("ping").to_dict()]
    assert registry.schemas("json") == registry.schemas("plain")


def test_schemas_openai(registry):
    assert registry.schemas("openai")[0] == {"type": "function", "function": GREP}


def test_schemas_openai_responses(registry):
    # The SDK's FunctionToolParam requires "strict".
    assert registry.schemas("openai-responses")[0] == {"type": "function", **GREP, "strict": False}


def test_schemas_anthropic(registry):
    assert registry.schemas("anthropic")[0] == {
        "name": "search_files",
        "description": "Search the worktree",
        "input_schema": GREP["parameters"],
    }


def test_schemas_mcp(registry):
    assert registry.schemas("mcp")[0] == {
        "name": "search_files",
        "description": "Search the worktree",
        "inputSchema": GREP["parameters"],
    }


@pytest.mark.parametrize("fmt", ["plain", "openai", "openai-responses", "anthropic", "mcp"])
def test_schemas_leave_out_hidden_tools_and_are_json(registry, fmt):
    schemas = registry.schemas(fmt)
    assert len(schemas) == 2
    assert "facts_commit" not in json.dumps(schemas)


def test_schemas_are_fresh_copies(registry):
    registry.schemas("anthropic")[0]["input_schema"]["required"].clear()
    assert registry.schemas("anthropic")[0]["input_schema"]["required"] == ["query"]


def test_an_unknown_schema_format_lists_the_known_ones(registry):
    with pytest.raises(ValueError, match="unknown schema format 'cohere'; known: plain, json, "
                                         "openai, openai-responses, anthropic, mcp, gemini"):
        registry.schemas("cohere")
    with pytest.raises(ValueError):
        registry.schemas(["openai"])


# -- call


def test_call_runs_the_tool_with_context(registry):
    assert registry.call("search_files", {"query": "x"}, {"root": "/w"}).output == "found x in /w"


def test_call_of_an_unknown_tool_is_a_failure_naming_advertised_tools_only(registry):
    result = registry.call("nope", {})
    assert result == Result.failure("Unknown tool: nope. Available tools: search_files, ping")


def test_call_in_an_empty_registry_says_so():
    assert Registry().call("x", {}).error == "Unknown tool: x. No tools are available."


def test_call_reaches_a_hidden_tool(registry):
    assert registry.call("facts_commit", None).output == "committed"


def test_call_with_invalid_arguments_is_the_validation_failure(registry):
    assert registry.call("search_files", {}).error == (
        "search_files: invalid arguments: 'query' is a required property"
    )


# -- dispatch: OpenAI Chat Completions


def test_openai_success(registry):
    reply = registry.dispatch(openai("search_files", '{"query": "todo"}'), {"root": "/w"})
    assert reply == {"role": "tool", "tool_call_id": "call_1", "content": "found todo in /w"}


def test_openai_arguments_already_decoded(registry):
    reply = registry.dispatch(openai("search_files", {"query": "todo"}))
    assert reply["content"] == "found todo in ?"


@pytest.mark.parametrize("arguments", ["", "  ", None, "{}"])
def test_openai_empty_arguments_mean_no_arguments(registry, arguments):
    assert registry.dispatch(openai("ping", arguments))["content"] == "pong"


def test_openai_sdk_objects_are_read_by_attribute(registry):
    call = types.SimpleNamespace(
        id="call_9", type="function",
        function=types.SimpleNamespace(name="search_files", arguments='{"query": "q"}'),
    )
    assert registry.dispatch(call) == {
        "role": "tool", "tool_call_id": "call_9", "content": "found q in ?",
    }


def test_openai_unknown_tool(registry):
    assert registry.dispatch(openai("rm_rf", "{}")) == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": "Error: Unknown tool: rm_rf. Available tools: search_files, ping",
    }


def test_openai_unknown_tool_is_reported_before_bad_json(registry):
    content = registry.dispatch(openai("rm_rf", "{nope"))["content"]
    assert content.startswith("Error: Unknown tool: rm_rf.")


def test_openai_invalid_json(registry):
    content = registry.dispatch(openai("search_files", '{"query": "x"'))["content"]
    assert content.startswith("Error: search_files: invalid arguments: arguments are not valid JSON: ")
    assert "line 1 column" in content


@pytest.mark.parametrize("arguments, kind", [
    ("[1, 2]", "array"), ('"q"', "string"), ("3", "number"), ("true", "boolean"),
    ("null", None), (["q"], "array"),
])
def test_openai_arguments_that_are_not_an_object(registry, arguments, kind):
    content = registry.dispatch(openai("search_files", arguments))["content"]
    if kind is None:  # JSON null: no arguments, so the schema complains instead
        assert content == "Error: search_files: invalid arguments: 'query' is a required property"
    else:
        assert content == (
            f"Error: search_files: invalid arguments: arguments must be a JSON object, not {kind}"
        )


def test_openai_invalid_arguments(registry):
    content = registry.dispatch(openai("search_files", '{"query": "x", "limit": "ten"}'))["content"]
    assert content == (
        "Error: search_files: invalid arguments: $.limit: 'ten' is not of type 'integer'"
    )


def test_openai_tool_that_raises(registry):
    content = registry.dispatch(openai("search_files", '{"query": "explode"}'))["content"]
    assert content == "Error: search_files: OSError: index gone"


def test_openai_deeply_nested_json_does_not_raise(registry):
    content = registry.dispatch(openai("search_files", "[" * 100_000 + "]" * 100_000))["content"]
    assert content.startswith("Error: search_files: invalid arguments:")


def test_openai_missing_id_and_name(registry):
    reply = registry.dispatch({"type": "function", "function": {"arguments": "{}"}})
    assert reply["tool_call_id"] == ""
    assert reply["content"].startswith("Error: Unknown tool: None. Available tools:")


# -- dispatch: OpenAI Responses


def test_responses_success_and_failure(registry):
    call = {"type": "function_call", "call_id": "fc_1", "name": "ping", "arguments": "{}"}
    assert registry.dispatch(call) == {
        "type": "function_call_output", "call_id": "fc_1", "output": "pong",
    }
    call["name"] = "nope"
    assert registry.dispatch(call)["output"].startswith("Error: Unknown tool: nope.")


# -- dispatch: Anthropic


def test_anthropic_success(registry):
    reply = registry.dispatch(anthropic("search_files", {"query": "todo"}), {"root": "/w"})
    assert reply == {
        "type": "tool_result", "tool_use_id": "toolu_1", "content": "found todo in /w",
        "is_error": False,
    }


def test_anthropic_sdk_objects_are_read_by_attribute(registry):
    block = types.SimpleNamespace(type="tool_use", id="toolu_7", name="ping", input={})
    assert registry.dispatch(block)["content"] == "pong"


def test_anthropic_unknown_tool(registry):
    assert registry.dispatch(anthropic("rm_rf", {})) == {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": "Unknown tool: rm_rf. Available tools: search_files, ping",
        "is_error": True,
    }


def test_anthropic_input_that_is_not_an_object(registry):
    reply = registry.dispatch(anthropic("search_files", ["todo"]))
    assert reply["is_error"] is True
    assert reply["content"] == (
        "search_files: invalid arguments: arguments must be a JSON object, not array"
    )


def test_anthropic_input_as_a_json_string_is_decoded(registry):
    assert registry.dispatch(anthropic("search_files", '{"query": "q"}'))["content"] == "found q in ?"
    reply = registry.dispatch(anthropic("search_files", "{bad"))
    assert reply["is_error"] and "not valid JSON" in reply["content"]


def test_anthropic_invalid_arguments(registry):
    reply = registry.dispatch(anthropic("search_files", {"query": 3}))
    assert reply["is_error"] is True
    assert reply["content"] == "search_files: invalid arguments: $.query: 3 is not of type 'string'"


def test_anthropic_tool_that_raises(registry):
    reply = registry.dispatch(anthropic("search_files", {"query": "explode"}))
    assert (reply["content"], reply["is_error"]) == ("search_files: OSError: index gone", True)


def test_anthropic_missing_input_means_no_arguments(registry):
    assert registry.dispatch({"type": "tool_use", "id": "t", "name": "ping"})["content"] == "pong"


# -- dispatch: the rest


def test_dispatch_does_not_reach_hidden_tools(registry):
    reply = registry.dispatch(anthropic("facts_commit", {}))
    assert reply["is_error"] and reply["content"].startswith("Unknown tool: facts_commit. Available tools: ")
    assert "facts_commit" not in reply["content"].split("Available tools: ")[1]


def test_dispatch_reaches_hidden_tools_when_the_registry_allows_it(registry):
    allowed = Registry(registry.tools, allow_hidden=True)
    assert allowed.dispatch(anthropic("facts_commit", {}))["content"] == "committed"
    assert allowed.subset("facts_commit").allow_hidden is True


def test_the_application_calls_hidden_tools_by_name(registry):
    assert registry.call("facts_commit", {}).output == "committed"


@pytest.mark.parametrize("tool_call", [
    {}, None, "ping", 42, [], {"type": "weird", "name": "ping"}, types.SimpleNamespace(),
])
def test_an_unrecognisable_tool_call_gets_an_openai_shaped_error(registry, tool_call):
    reply = registry.dispatch(tool_call)
    assert set(reply) == {"role", "tool_call_id", "content"}
    assert reply["role"] == "tool" and reply["tool_call_id"] == ""
    assert reply["content"].startswith("Error: unrecognised tool call: expected an OpenAI")


def test_a_non_str_id_is_turned_into_text(registry):
    assert registry.dispatch(openai("ping", "{}", id=12))["tool_call_id"] == "12"
