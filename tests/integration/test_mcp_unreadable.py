"""``dispatch mcp`` answers a line it cannot read instead of dropping it: a
real daemon, ``dispatch mcp`` as a subprocess, raw JSON-RPC lines on its
stdin (the SDK's client cannot send what these are). A ``tools/call`` whose
arguments nest 200 deep, a request nested 100,000 deep, a line that is not
JSON and one that is no JSON-RPC message each get a JSON-RPC error with
their id (``null`` when none can be read) and a line on stderr; a deep
notification is noted, not answered. The twins: a call nested 50 deep is a
tool result (``isError``), and a plain call after them all is served."""

from __future__ import annotations

import io
import json
import os
import select
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dispatch
from tests.conftest import Daemon
from tests.integration.test_mcp import _command, _sessions_on


def _call(rid: int | str, depth: int) -> bytes:
    nested = "[" * depth + "]" * depth
    return ('{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"shell_exec",'
            '"arguments":{"command":"true","x":%s}}}' % (json.dumps(rid), nested)).encode()


DEEP_CALL = _call(10, 200)
DEEP_LIST = b'{"jsonrpc":"2.0","id":"deep","method":"tools/list","params":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
DEEP_NOTE = b'{"jsonrpc":"2.0","method":"notifications/progress","params":{"x":' + b"[" * 300 + b"]" * 300 + b"}}"
NOT_JSON = b'{"jsonrpc":"2.0","id":12,"method":"tools/call","params":{"name":'
NOT_RPC = b'{"jsonrpc":"1.0","id":13,"method":"ping"}'
GARBAGE = b"garbage"
DEEP = "Invalid Request: the message is nested too deeply to read (recursion limit exceeded at line 1 column {})"
NOT_A_MESSAGE = ('Invalid Request: not a JSON-RPC 2.0 message (it needs "jsonrpc": "2.0", a "method" and an "id" '
                 "that is a string or an integer)")


def _column(line: bytes) -> int:
    """The column the SDK's parser (pydantic-core: 200 levels) names when it
    stops: just past the bracket that opens level 201."""
    depth = 0
    for i, byte in enumerate(line):
        depth += byte in b"[{"
        if depth > 200:
            return i + 2
    raise AssertionError("not that deep")


class _Mcp:
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def send(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()

    def read(self, timeout: float = 60) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, "no reply"
        reply: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return reply


@contextmanager
def started(daemon: Daemon, worktree: Path, stderr: Any = subprocess.PIPE) -> Iterator[_Mcp]:
    """``dispatch mcp`` on ``worktree``, initialized, its stdin left open;
    killed at the end if it still runs."""
    proc = subprocess.Popen(_command(daemon, worktree), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=stderr, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    # Its stdout unbuffered: a line read leaves the next in the pipe, where read()'s select sees it.
    assert isinstance(proc.stdout, io.BufferedReader)
    proc.stdout = proc.stdout.detach()  # type: ignore[assignment]
    mcp = _Mcp(proc)
    try:
        mcp.send(json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}).encode())
        assert mcp.read()["id"] == 0
        mcp.send(b'{"jsonrpc":"2.0","method":"notifications/initialized"}')
        yield mcp
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in filter(None, (proc.stdin, proc.stdout, proc.stderr)):
            pipe.close()


def _error(rid: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}}


def test_unreadable_lines_are_answered_and_the_server_goes_on(
    daemon: Daemon, client: dispatch.Client, worktree: Path
) -> None:
    with started(daemon, worktree) as mcp:
        # The twin within the parser's depth: a tool's own refusal, as a result.
        mcp.send(_call(9, 50))
        shallow = mcp.read()
        assert shallow["id"] == 9 and shallow["result"]["isError"] is True
        assert shallow["result"]["content"][0]["text"].startswith("shell_exec: invalid arguments: ")
        mcp.send(DEEP_CALL)
        assert mcp.read() == _error(10, -32600, DEEP.format(_column(DEEP_CALL)))
        mcp.send(DEEP_LIST)
        assert mcp.read() == _error("deep", -32600, DEEP.format(_column(DEEP_LIST)))
        mcp.send(DEEP_NOTE)  # a notification: noted, not answered (the next reply is the next request's)
        mcp.send(NOT_JSON)
        assert mcp.read() == _error(12, -32700, "Parse error: EOF while parsing a value at line 2 column 0")
        mcp.send(NOT_RPC)
        assert mcp.read() == _error(13, -32600, NOT_A_MESSAGE)
        mcp.send(GARBAGE)
        assert mcp.read() == _error(None, -32700, "Parse error: expected value at line 1 column 1")
        # The twin: a plain call is served after all of them.
        mcp.send(json.dumps({"jsonrpc": "2.0", "id": 99, "method": "tools/call", "params": {
            "name": "shell_exec", "arguments": {"command": "echo alive"}}}).encode())
        alive = mcp.read()
        assert alive["id"] == 99 and alive["result"]["isError"] is False
        assert alive["result"]["content"][0]["text"] == "alive\n"
        _, err = mcp.proc.communicate(timeout=30)  # closes its stdin: it ends, and closes its session
    assert mcp.proc.returncode == 0
    notes = [line for line in err.decode().splitlines() if line.startswith("dispatch mcp: ")]
    assert notes == [
        f"dispatch mcp: answered id 10 with error -32600: {DEEP.format(_column(DEEP_CALL))}",
        f'dispatch mcp: answered id "deep" with error -32600: {DEEP.format(_column(DEEP_LIST))}',
        f"dispatch mcp: ignored a message it cannot read (not a request): {DEEP.format(_column(DEEP_NOTE))}",
        "dispatch mcp: answered id 12 with error -32700: Parse error: EOF while parsing a value at line 2 column 0",
        f"dispatch mcp: answered id 13 with error -32600: {NOT_A_MESSAGE}",
        "dispatch mcp: answered id null with error -32700: Parse error: expected value at line 1 column 1",
    ], err.decode()
    assert "Traceback" not in err.decode()
    assert _sessions_on(client, worktree) == []


# Each id MCP cannot carry, as written on the line (JSON-RPC: a message with an
# "id" member is a request, answered; only one without is a notification).
BAD_IDS = ["1.5", "null", "true", '{"a":1}', "[1]", "3.0", "1e3", "NaN"]


def test_a_request_whose_id_is_no_string_or_integer_is_answered_not_run(
    daemon: Daemon, client: dispatch.Client, worktree: Path
) -> None:
    shown = {"1.5": "1.5", "null": "null", "true": "true", '{"a":1}': "an object or an array",
             "[1]": "an object or an array", "3.0": "3.0", "1e3": "1000.0", "NaN": "NaN"}
    with started(daemon, worktree) as mcp:
        for i, rid in enumerate(BAD_IDS):
            mcp.send(('{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"shell_exec",'
                      '"arguments":{"command":"echo ran > bad%d.txt"}}}' % (rid, i)).encode())
            assert mcp.read() == _error(None, -32600, f'Invalid Request: its "id" ({shown[rid]}) is neither a '
                                                      'string nor an integer; a message with no "id" is a notification')
            mcp.send(b'{"jsonrpc":"2.0","id":%s,"method":"ping"}' % rid.encode())
            assert mcp.read()["error"]["code"] == -32600
        # A notification (no "id" at all) stays one: not answered, and a
        # tools/call sent as one is not run; the next reply is the next request's.
        mcp.send(b'{"jsonrpc":"2.0","method":"tools/call","params":{"name":"shell_exec",'
                 b'"arguments":{"command":"echo ran > notified.txt"}}}')
        # The twins: a string id and an integer id are served, echoed as they came.
        for rid in ('"s-1"', "7", "-3"):
            mcp.send(('{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"shell_exec",'
                      '"arguments":{"command":"echo served"}}}' % rid).encode())
            served = mcp.read()
            assert served["id"] == json.loads(rid) and served["result"]["isError"] is False
            assert served["result"]["content"][0]["text"] == "served\n"
        mcp.send(b'{"jsonrpc":"2.0","id":8,"method":"ping"}')
        assert mcp.read() == {"jsonrpc": "2.0", "id": 8, "result": {}}
        _, err = mcp.proc.communicate(timeout=30)
    assert mcp.proc.returncode == 0
    assert sorted(p.name for p in worktree.iterdir() if p.name.endswith(".txt")) == []
    notes = [line for line in err.decode().splitlines() if line.startswith("dispatch mcp: ")]
    assert len(notes) == 2 * len(BAD_IDS)
    assert notes[0] == ('dispatch mcp: answered id null with error -32600: Invalid Request: its "id" (1.5) is neither '
                        'a string nor an integer; a message with no "id" is a notification')
    assert _sessions_on(client, worktree) == []
