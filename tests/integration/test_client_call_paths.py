"""A session's read_file through every public spelling gives the same Result,
against a real daemon: a held ``Definition``'s ``call``, ``Registry.call``,
``Registry.dispatch`` and ``Session.call_tool``; bad arguments give the same
message on the paths that validate in the client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import dispatch
from dispatch.client import Cancellation
from dispatch.errors import RequestFailed

TEXT = "".join(f"line {i}\n" for i in range(40))
NUMBERED = "\n".join(f"{i}: line {i}" for i in range(40))  # no newline after the last


def _meta(result: dispatch.Result) -> dict[str, Any]:
    """Metadata without its usage (numbers that vary from call to call)."""
    return {k: v for k, v in result.metadata.items() if k != "usage"}


def test_every_spelling_reads_the_same_result(session: dispatch.Session, worktree: Path) -> None:
    (worktree / "f.txt").write_text(TEXT)
    tools = session.registry
    read = tools.get("read_file")
    params = {"path": "f.txt"}
    results = [read.call(params), tools.call("read_file", params), tools.get("read_file").call(params),
               session.call_tool("read_file", params), read.call(params, {"cancellation": Cancellation()})]
    for result in results:
        assert result.is_success and result.error is None
        assert result.output == NUMBERED
        assert _meta(result) == {"path": "f.txt", "total_lines": 40, "start_line": 0, "end_line": 39}
        assert set(result.metadata["usage"]) >= {"cpu_s"}
    reply = tools.dispatch({"id": "c1", "type": "function",
                            "function": {"name": "read_file", "arguments": json.dumps(params)}})
    assert reply == {"role": "tool", "tool_call_id": "c1", "content": NUMBERED}
    # The caller's dict is left as it was, and a part reads the same way on each path.
    assert params == {"path": "f.txt"}
    part = {"path": "f.txt", "start_line": 3, "end_line": 4}
    assert read.call(part).output == tools.call("read_file", part).output == "3: line 3\n4: line 4"


def test_bad_arguments_give_the_same_message_on_each_client_path(session: dispatch.Session, worktree: Path) -> None:
    (worktree / "f.txt").write_text(TEXT)
    tools = session.registry
    read = tools.get("read_file")
    expected = {
        str({"path": 7}): "read_file: invalid arguments: $.path: 7 is not of type 'string'",
        str({"path": "f.txt", "extra": 1}):
            "read_file: invalid arguments: Additional properties are not allowed ('extra' was unexpected)",
        str({}): "read_file: invalid arguments: 'path' is a required property",
        str({"path": "f.txt", "start_line": -2}): "read_file: invalid arguments: $.start_line: -2 is less than the minimum of 0",
    }
    for bad in ({"path": 7}, {"path": "f.txt", "extra": 1}, {}, {"path": "f.txt", "start_line": -2}):
        one, two = read.call(bad), tools.call("read_file", bad)
        assert one == two, bad
        assert one.is_failure and one.error == expected[str(bad)]
    # The allowed twin: the nearest good call reads.
    assert read.call({"path": "f.txt", "start_line": 0}).output == NUMBERED
    missing = tools.call("read_file", {"path": "absent.txt"})  # valid, refused by the sandbox's tool
    assert missing.is_failure and "absent.txt" in (missing.error or "")
    assert missing.error == read.call({"path": "absent.txt"}).error


def test_attaching_to_an_ended_session_says_why_it_ended(client: dispatch.Client, worktree: Path) -> None:
    """``Client.session(id)`` of a session that has ended says why, as the
    daemon keeps it; the twin: a live one is attached, and an id never
    opened is only unknown."""
    s = client.open_session(str(worktree))
    with client.session(s.id) as again:  # attached here: closing this handle does not end it
        assert again.id == s.id
    s.close()
    with pytest.raises(RequestFailed) as ended:
        client.session(s.id)
    assert (ended.value.code, str(ended.value)) == (
        "unknown_session", f"no such session: '{s.id}' (it has ended: it was closed)")
    with pytest.raises(RequestFailed) as never:
        client.session("000000000000")
    assert (never.value.code, str(never.value)) == ("unknown_session", "no such session: '000000000000'")
