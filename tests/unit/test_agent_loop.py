"""run_tool_loop with a deterministic fake model (seed 002's offline harness):
multi-step loops, invalid arguments, unknown tools, a denied approval, the
runaway cap, and compaction with retrieval; for OpenAI and Anthropic shapes."""

import itertools
import json
import re
import types

import pytest

from dispatch.agent import (
    FakeModel,
    LoopResult,
    ScriptExhausted,
    Trace,
    anthropic_model,
    openai_chat_model,
    run_tool_loop,
)
from dispatch.tools import Definition, Registry, Result

PROVIDERS = ["openai", "anthropic"]


class Files:
    """A tiny in-memory worktree with read, write and run tools."""

    def __init__(self):
        self.files = {"README.md": "hello\n"}
        self.ran = []

    def registry(self, **kw):
        path = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
                "additionalProperties": False}
        write = {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                 "required": ["path", "content"], "additionalProperties": False}
        run = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
        return Registry([
            Definition("read_file", "Read a file", path, self.read, risk="read"),
            Definition("write_file", "Write a file", write, self.write, risk="write"),
            Definition("shell_exec", "Run a command", run, self.run, risk="execute"),
            Definition("facts_commit", "Not for models", {"type": "object"},
                       lambda p, c: Result.success("committed"), advertised=False),
        ], **kw)

    def read(self, params, context):
        if params["path"] not in self.files:
            return Result.failure(f"read_file: no such file: {params['path']}")
        return Result.success(self.files[params["path"]])

    def write(self, params, context):
        self.files[params["path"]] = params["content"]
        return Result.success(f"wrote {len(params['content'])} bytes to {params['path']}")

    def run(self, params, context):
        self.ran.append(params["command"])
        if params["command"] == "seq":
            return Result.success("".join(f"{i}\n" for i in range(1, 5001)))
        return Result.success(f"ran {params['command']}")


def tool_results(messages, provider):
    """The texts of the tool results in the last message(s) the model was given."""
    if provider == "openai":
        out = []
        for m in reversed(messages):
            if m.get("role") != "tool":
                break
            out.insert(0, m["content"])
        return out
    return [b["content"] for b in messages[-1]["content"]]


# -- a multi-step loop


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_multi_step_loop_reads_writes_and_answers(provider):
    files = Files()
    seen = []

    def copy_readme(messages):
        (text,) = tool_results(messages, provider)
        seen.append(text)
        return [("write_file", {"path": "COPY.md", "content": text})]

    model = FakeModel([[("read_file", {"path": "README.md"})], copy_readme, "Copied."], provider=provider)
    given = [{"role": "user", "content": "copy the readme"}]
    result = run_tool_loop(model, files.registry(), given, provider=provider)

    assert (result.status, result.final, result.iterations, result.done) == ("done", "Copied.", 3, True)
    assert seen == ["hello\n"] and files.files["COPY.md"] == "hello\n"
    assert given == [{"role": "user", "content": "copy the readme"}]  # not changed
    assert len(model.requests) == 3
    # The model was offered the advertised tools, in its provider's shape.
    tools = model.requests[0][1]
    names = [t["function"]["name"] if provider == "openai" else t["name"] for t in tools]
    assert names == ["read_file", "write_file", "shell_exec"]


def test_openai_conversation_shape():
    files = Files()
    model = FakeModel([[("read_file", {"path": "README.md"}), ("read_file", {"path": "nope"})], "ok"])
    result = run_tool_loop(model, files.registry(), [{"role": "user", "content": "go"}])
    assert result.messages == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "README.md"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "nope"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "hello\n"},
        {"role": "tool", "tool_call_id": "call_2", "content": "Error: read_file: no such file: nope"},
        {"role": "assistant", "content": "ok"},
    ]


def test_anthropic_conversation_shape():
    files = Files()
    model = FakeModel([[("read_file", {"path": "README.md"}), ("read_file", {"path": "nope"})], "ok"],
                      provider="anthropic")
    result = run_tool_loop(model, files.registry(), [{"role": "user", "content": "go"}], provider="anthropic")
    assert result.messages == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "README.md"}},
            {"type": "tool_use", "id": "toolu_2", "name": "read_file", "input": {"path": "nope"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "hello\n", "is_error": False},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "read_file: no such file: nope",
             "is_error": True},
        ]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
    ]


# -- invalid arguments and unknown tools: the model reads the failure and recovers


@pytest.mark.parametrize("provider", PROVIDERS)
def test_invalid_arguments_come_back_and_the_model_recovers(provider):
    files = Files()
    errors = []

    def retry(messages):
        errors.extend(tool_results(messages, provider))
        return [("read_file", {"path": "README.md"})]

    model = FakeModel([
        [("read_file", '{"path": "README.md"'), ("read_file", {"path": 7}), ("read_file", {"file": "x"})],
        retry,
        "done",
    ], provider=provider)
    trace = Trace()
    result = run_tool_loop(model, files.registry(), [], provider=provider, trace=trace)
    assert result.status == "done"
    prefix = "Error: " if provider == "openai" else ""
    assert errors[0].startswith(prefix + "read_file: invalid arguments: arguments are not valid JSON:")
    assert errors[1] == prefix + "read_file: invalid arguments: $.path: 7 is not of type 'string'"
    assert errors[2].startswith(prefix + "read_file: invalid arguments: ")
    assert [e.success for e in trace] == [False, False, False, True]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_an_unknown_tool_names_the_advertised_ones(provider):
    files = Files()
    model = FakeModel([[("delete_everything", {})], "sorry"], provider=provider)
    trace = Trace()
    result = run_tool_loop(model, files.registry(), [], provider=provider, trace=trace)
    (text,) = tool_results(result.messages[:-1], provider)
    assert text.endswith("Unknown tool: delete_everything. Available tools: read_file, write_file, shell_exec")
    assert trace[0].tool == "delete_everything" and trace[0].success is False


def test_a_hidden_tool_is_neither_offered_nor_callable_by_the_model():
    files = Files()
    model = FakeModel([[("facts_commit", {})], "ok"])
    result = run_tool_loop(model, files.registry(), [])
    assert "facts_commit" not in json.dumps(model.requests[0][1])
    assert result.messages[1]["content"] == (
        "Error: Unknown tool: facts_commit. Available tools: read_file, write_file, shell_exec")


def test_a_hidden_tool_runs_when_the_application_allows_it():
    files = Files()
    model = FakeModel([[("facts_commit", {})], "ok"])
    result = run_tool_loop(model, files.registry(allow_hidden=True), [])
    assert "facts_commit" not in json.dumps(model.requests[0][1])
    assert result.messages[1]["content"] == "committed"


# -- approval


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_denied_approval_reaches_the_model_and_nothing_changes(provider):
    files = Files()
    asked = []

    def approve(definition, params, context):
        asked.append((definition.name, params, context))
        return "the user said no" if definition.name == "shell_exec" else True

    model = FakeModel([
        [("shell_exec", {"command": "rm -rf /"}), ("write_file", {"path": "a", "content": "b"}),
         ("read_file", {"path": "README.md"})],
        "ok, I will not",
    ], provider=provider)
    trace = Trace()
    result = run_tool_loop(model, files.registry(approve=approve), [], provider=provider, trace=trace,
                           context={"user": "ann"})
    assert result.done and files.ran == [] and files.files["a"] == "b"
    assert asked == [("shell_exec", {"command": "rm -rf /"}, {"user": "ann"}),
                     ("write_file", {"path": "a", "content": "b"}, {"user": "ann"})]
    denied, written, read = trace.entries
    assert (denied.denied, denied.success, written.denied, read.denied) == (True, False, False, False)
    assert denied.content.endswith("shell_exec: denied by approval: the user said no")


# -- the runaway cap


@pytest.mark.parametrize("provider", PROVIDERS)
def test_the_cap_stops_a_model_that_never_stops(provider):
    files = Files()
    model = FakeModel(itertools.repeat([("read_file", {"path": "README.md"})]), provider=provider)
    trace = Trace()
    result = run_tool_loop(model, files.registry(), [{"role": "user", "content": "loop"}],
                           max_iterations=4, provider=provider, trace=trace)
    assert (result.status, result.iterations, result.final, result.done) == ("max_iterations", 4, None, False)
    assert len(model.requests) == 4 and len(trace) == 4
    assert [e.turn for e in trace] == [1, 2, 3, 4]
    # Every call is answered: the conversation can go on.
    last = result.messages[-1]
    assert last["role"] == "tool" if provider == "openai" else last["content"][0]["type"] == "tool_result"
    assert len(result.messages) == 1 + 4 * 2


def test_the_default_cap_is_25():
    model = FakeModel(itertools.repeat([("read_file", {"path": "README.md"})]))
    assert run_tool_loop(model, Files().registry(), []).iterations == 25


def test_a_model_that_answers_at_the_last_turn_is_done():
    model = FakeModel([[("read_file", {"path": "README.md"})], "fine"])
    assert run_tool_loop(model, Files().registry(), [], max_iterations=2).status == "done"


@pytest.mark.parametrize("cap", [0, -1, 2.5, True, "3"])
def test_the_cap_must_be_a_positive_int(cap):
    with pytest.raises(ValueError, match="max_iterations"):
        run_tool_loop(FakeModel(["x"]), Registry(), [], max_iterations=cap)


# -- compaction with retrieval


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_long_output_is_compacted_and_the_model_retrieves_the_rest(provider):
    files = Files()
    registry = files.registry(output_budget=300)
    pieces = []

    def retrieve_middle(messages):
        (text,) = tool_results(messages, provider)
        pieces.append(text)
        output_id = re.search(r'with id "(out_\d+)"', text).group(1)
        return [("retrieve_output", {"id": output_id, "start_line": 2499, "end_line": 2501})]

    def answer(messages):
        pieces.extend(tool_results(messages, provider))
        return "the middle is 2500-2502"

    model = FakeModel([[("shell_exec", {"command": "seq"})], retrieve_middle, answer], provider=provider)
    trace = Trace()
    result = run_tool_loop(model, registry, [], provider=provider, trace=trace)
    assert result.done
    compacted, middle = pieces
    assert len(compacted.encode()) <= 300 and compacted.lstrip("Error: ").startswith("1\n2\n")
    assert compacted.endswith("4999\n5000\n")
    assert middle == "2500\n2501\n2502\n[output out_1: lines 2499-2501 of 5000]"
    assert trace[0].output_id == "out_1" and trace[1].output_id is None
    assert registry.outputs.get("out_1") == "".join(f"{i}\n" for i in range(1, 5001))


# -- fake models


def test_a_script_that_runs_out_says_so():
    model = FakeModel(["only answer"])
    model([], [])
    with pytest.raises(ScriptExhausted, match="script has 1 turns"):
        model([], [])


def test_provider_shaped_calls_pass_through_in_order():
    raw = {"id": "mine", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}
    message = FakeModel([[("read_file", {"path": "a"}), raw]])([], [])
    assert [c["id"] for c in message["tool_calls"]] == ["call_1", "mine"]


def test_the_fake_model_keeps_copies_of_what_it_was_given():
    model = FakeModel(["a"])
    messages = [{"role": "user", "content": "x"}]
    model(messages, [{"name": "t"}])
    messages[0]["content"] = "changed"
    assert model.requests == [([{"role": "user", "content": "x"}], [{"name": "t"}])]


def test_an_unknown_provider_is_refused():
    with pytest.raises(ValueError, match="unknown provider 'cohere'; known: openai, openai-responses, anthropic"):
        run_tool_loop(FakeModel([]), Registry(), [], provider="cohere")
    with pytest.raises(ValueError):
        FakeModel([], provider="cohere")


# -- SDK objects and the SDK adapters


def ns(**kw):
    return types.SimpleNamespace(**kw)


def test_openai_sdk_messages_are_turned_into_plain_dicts():
    files = Files()
    replies = iter([
        ns(role="assistant", content=None, refusal=None, audio=None,
           tool_calls=[ns(id="c9", type="function", function=ns(name="read_file", arguments='{"path": "README.md"}'))]),
        ns(role="assistant", content="done", refusal=None, tool_calls=None),
    ])
    result = run_tool_loop(lambda m, t: next(replies), files.registry(), [])
    assert result.messages[0] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c9", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "README.md"}'}}]}
    assert result.messages[1] == {"role": "tool", "tool_call_id": "c9", "content": "hello\n"}
    assert result.messages[2] == {"role": "assistant", "content": "done"}
    assert result.final == "done"


def test_anthropic_sdk_messages_keep_only_role_and_content():
    files = Files()
    replies = iter([
        ns(id="msg_1", model="claude", role="assistant", stop_reason="tool_use", usage=ns(input_tokens=1),
           content=[ns(type="text", text="Reading.", citations=None),
                    ns(type="tool_use", id="toolu_9", name="read_file", input={"path": "README.md"})]),
        {"id": "msg_2", "role": "assistant", "content": [{"type": "text", "text": "It says hello."}]},
    ])
    result = run_tool_loop(lambda m, t: next(replies), files.registry(), [], provider="anthropic")
    assert result.messages[0] == {"role": "assistant", "content": [
        {"type": "text", "text": "Reading."},
        {"type": "tool_use", "id": "toolu_9", "name": "read_file", "input": {"path": "README.md"}}]}
    assert result.messages[2] == {"role": "assistant", "content": [{"type": "text", "text": "It says hello."}]}
    assert result.final == "It says hello."


def test_openai_chat_model_calls_the_client():
    sent = {}

    def create(**kw):
        sent.update(kw)
        return ns(choices=[ns(message=ns(role="assistant", content="hi", tool_calls=None))])

    client = ns(chat=ns(completions=ns(create=create)))
    result = run_tool_loop(openai_chat_model(client, "gpt-x", temperature=0), Files().registry(),
                           [{"role": "user", "content": "hello"}])
    assert result.final == "hi"
    assert sent["model"] == "gpt-x" and sent["temperature"] == 0
    assert sent["messages"] == [{"role": "user", "content": "hello"}]
    assert [t["function"]["name"] for t in sent["tools"]] == ["read_file", "write_file", "shell_exec"]


def test_anthropic_model_calls_the_client():
    sent = {}

    def create(**kw):
        sent.update(kw)
        return ns(role="assistant", content=[ns(type="text", text="hi")])

    client = ns(messages=ns(create=create))
    result = run_tool_loop(anthropic_model(client, "claude-x", system="be brief", max_tokens=100),
                           Files().registry(), [{"role": "user", "content": "hello"}], provider="anthropic")
    assert result.final == "hi"
    assert (sent["model"], sent["system"], sent["max_tokens"]) == ("claude-x", "be brief", 100)
    assert [t["name"] for t in sent["tools"]] == ["read_file", "write_file", "shell_exec"]
    assert set(sent["tools"][0]) == {"name", "description", "input_schema"}


def test_a_model_error_propagates():
    def down(messages, tools):
        raise ConnectionError("rate limited")

    with pytest.raises(ConnectionError):
        run_tool_loop(down, Files().registry(), [])


def test_loop_result_is_a_plain_record():
    r = LoopResult("done", [], 1, "x")
    assert r.done and r == LoopResult("done", [], 1, "x")
