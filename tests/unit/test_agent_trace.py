"""Trace: each call's tool, arguments, outcome and duration, as JSON lines,
and replayed by FakeModel.replaying for deterministic tests."""

import json

import pytest

from dispatch.agent import FakeModel, Trace, TraceEntry, run_tool_loop
from dispatch.tools import Definition, Registry, Result

PROVIDERS = ["openai", "anthropic"]


def registry():
    counter = {"n": 0}

    def bump(params, context):
        counter["n"] += params.get("by", 1)
        return Result.success(str(counter["n"]))

    schema = {"type": "object", "properties": {"by": {"type": "integer"}}, "additionalProperties": False}
    return Registry([Definition("bump", "Add to a counter", schema, bump, risk="write")])


SCRIPT = [
    [("bump", {"by": 2}), ("bump", {})],
    [("bump", '{"by": '), ("bump", {"by": "x"}), ("nope", {})],
    [("bump", {"by": 3})],
    "total 8",
]


def recorded(provider):
    trace = Trace()
    result = run_tool_loop(FakeModel(SCRIPT, provider=provider), registry(), [], provider=provider, trace=trace)
    assert result.final == "total 8"
    return trace


@pytest.mark.parametrize("provider", PROVIDERS)
def test_each_call_is_recorded(provider):
    trace = recorded(provider)
    assert [(e.turn, e.tool, e.arguments, e.success) for e in trace] == [
        (1, "bump", {"by": 2}, True),
        (1, "bump", {}, True),
        (2, "bump", '{"by": ', False),  # undecodable: kept as the model sent it
        (2, "bump", {"by": "x"}, False),
        (2, "nope", {}, False),
        (3, "bump", {"by": 3}, True),
    ]
    assert [e.content.removeprefix("Error: ") for e in trace][:2] == ["2", "3"]
    assert trace[4].content.removeprefix("Error: ") == "Unknown tool: nope. Available tools: bump"
    prefix = "call_" if provider == "openai" else "toolu_"
    assert [e.call_id for e in trace] == [f"{prefix}{n}" for n in range(1, 7)]
    assert all(isinstance(e.duration_s, float) and 0 <= e.duration_s < 5 for e in trace)
    assert trace.calls()[0] == ("bump", {"by": 2}, True)


def test_jsonl_round_trip(tmp_path):
    trace = recorded("openai")
    path = tmp_path / "trace.jsonl"
    trace.write_jsonl(path)
    lines = path.read_text().splitlines()
    assert len(lines) == 6
    first = json.loads(lines[0])
    assert set(first) == {"turn", "call_id", "tool", "arguments", "success", "duration_s", "content",
                          "output_id", "denied"}
    again = Trace.read_jsonl(path)
    assert again.entries == trace.entries
    assert Trace.from_jsonl(trace.to_jsonl()).entries == trace.entries


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("replay_as", PROVIDERS)
def test_a_replay_makes_the_same_calls_with_the_same_outcomes(tmp_path, provider, replay_as):
    original = recorded(provider)
    original.write_jsonl(tmp_path / "t.jsonl")
    replayed = Trace()
    model = FakeModel.replaying(Trace.read_jsonl(tmp_path / "t.jsonl"), provider=replay_as)
    result = run_tool_loop(model, registry(), [], provider=replay_as, trace=replayed)
    assert (result.status, result.final, result.iterations) == ("done", "done", 4)
    assert replayed.calls() == original.calls()
    assert [e.turn for e in replayed] == [e.turn for e in original]


def test_a_trace_entry_is_plain_data():
    e = TraceEntry(1, "c", "t", {"a": [1]}, True, 0.5, "out")
    assert TraceEntry.from_dict(e.to_dict()) == e
    assert TraceEntry.from_dict({**e.to_dict(), "future_field": 1}) == e


def test_a_bad_line_is_named():
    with pytest.raises(ValueError, match="trace line 2 is not a trace entry"):
        Trace.from_jsonl('{"turn": 1, "call_id": "", "tool": "t", "arguments": {}, "success": true, '
                         '"duration_s": 0, "content": ""}\n{"turn": 1}\n')
    assert len(Trace.from_jsonl("\n\n")) == 0


def test_trace_is_a_sequence():
    trace = recorded("anthropic")
    assert len(trace) == 6 and trace[0].tool == "bump" and list(trace) == trace.entries
    assert repr(trace) == "Trace(6 calls)"
