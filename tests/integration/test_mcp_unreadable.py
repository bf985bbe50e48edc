"""``dispatch mcp`` answers a line it cannot read instead of dropping it: a
real daemon, ``dispatch mcp`` as a subprocess, raw JSON-RPC lines on its
stdin (the SDK's client cannot send what these are). A ``tools/call`` whose
arguments nest 200 deep, a request nested 100,000 deep, a line that is not
JSON and one that is no JSON-RPC message each get a JSON-RPC error with
their id (``null`` when none can be read) and a line on stderr; a deep
notification is noted, not answered. The twins: a call nested 50 deep is a
tool result (``isError``), and a plain call after them all is served."""

from __future__ import annotations

import json
import os
import select
import subprocess
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


def _error(rid: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}}


def test_unreadable_lines_are_answered_and_the_server_goes_on(
    daemon: Daemon, client: dispatch.Client, worktree: Path
) -> None:
    proc = subprocess.Popen(_command(daemon, worktree), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    mcp = _Mcp(proc)
    try:
        mcp.send(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-03-26", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}).encode())
        assert mcp.read()["id"] == 1
        mcp.send(b'{"jsonrpc":"2.0","method":"notifications/initialized"}')
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
        _, err = proc.communicate(timeout=30)  # closes its stdin: it ends, and closes its session
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
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
