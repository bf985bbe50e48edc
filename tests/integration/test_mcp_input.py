"""``dispatch mcp`` given lines the SDK would misread: one that is not UTF-8
(refused whole, never written with its bytes replaced), a batch (each request
in it answered "not supported", none run) and a ``tools/call`` whose params
are of the wrong type (``-32602`` saying which), a line over ``MAX_LINE``
(answered, dropped as it comes: never held whole). A real daemon, raw JSON-RPC
lines on its stdin. The twins: UTF-8 content is written as sent, the same
requests one a line are served, arguments as an object are served, a long
line under the limit is served."""

from __future__ import annotations

import json
from pathlib import Path

import dispatch
from dispatch._mcp_stdio import MAX_LINE
from tests.conftest import Daemon
from tests.integration.test_mcp import _sessions_on
from tests.integration.test_mcp_unreadable import NOT_A_MESSAGE, _error, started

NO_BATCHES = "Invalid Request: batches are not supported; send each message on a line of its own"


def _call(rid: int, params: object) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params}).encode()


def test_a_line_not_utf8_is_refused_not_written_altered(daemon: Daemon, client: dispatch.Client,
                                                        worktree: Path) -> None:
    with started(daemon, worktree) as mcp:
        line = (b'{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"write_file",'
                b'"arguments":{"path":"u.txt","content":"a\xff\xfeb"}}}')
        why = "Parse error: the line is not UTF-8 (byte 116)"  # the first bad byte, from 0
        assert line.index(b"\xff") == 116
        mcp.send(line)
        assert mcp.read() == _error(8, -32700, why)
        assert not (worktree / "u.txt").exists()
        # The twin: the same call in UTF-8 writes what was sent.
        mcp.send(_call(9, {"name": "write_file", "arguments": {"path": "u.txt", "content": "a\u00e9b"}}))
        written = mcp.read()
        assert written["id"] == 9 and written["result"]["isError"] is False
        assert (worktree / "u.txt").read_bytes() == b"a\xc3\xa9b"
        _, err = mcp.proc.communicate(timeout=30)
    assert mcp.proc.returncode == 0
    assert [line for line in err.decode().splitlines() if line.startswith("dispatch mcp: ")] == [
        f"dispatch mcp: answered id 8 with error -32700: {why}"]
    assert _sessions_on(client, worktree) == []


def test_each_request_in_a_batch_is_answered_none_run(daemon: Daemon, client: dispatch.Client,
                                                      worktree: Path) -> None:
    run = {"name": "shell_exec", "arguments": {"command": "echo ran > ran.txt"}}
    with started(daemon, worktree) as mcp:
        mcp.send(b'[{"jsonrpc":"2.0","id":1,"method":"ping"},' + _call(2, run) +
                 b',{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":1}},7]')
        assert [mcp.read() for _ in range(3)] == [_error(1, -32600, NO_BATCHES), _error(2, -32600, NO_BATCHES),
                                                  _error(None, -32600, NO_BATCHES)]
        mcp.send(b"[]")
        assert mcp.read() == _error(None, -32600, NO_BATCHES)
        assert not (worktree / "ran.txt").exists()
        # The twin: the same requests, one a line, are served.
        mcp.send(b'{"jsonrpc":"2.0","id":1,"method":"ping"}')
        assert mcp.read() == {"jsonrpc": "2.0", "id": 1, "result": {}}
        mcp.send(_call(2, run))
        assert mcp.read()["result"]["isError"] is False
        assert (worktree / "ran.txt").read_text() == "ran\n"


def test_a_call_with_params_of_the_wrong_type_is_told_which(daemon: Daemon, client: dispatch.Client,
                                                             worktree: Path) -> None:
    with started(daemon, worktree) as mcp:
        for params, why in (({"name": "list_files", "arguments": "x"}, "arguments must be an object, not string"),
                            ({"name": "list_files", "arguments": [1]}, "arguments must be an object, not array"),
                            ({"name": 3, "arguments": {}}, "name must be a string, not number"),
                            ({"arguments": {}}, 'params has no "name"'),
                            (None, 'params must be an object with a "name", not null')):
            mcp.send(_call(4, params))
            assert mcp.read() == _error(4, -32602, f"tools/call: {why}"), params
        mcp.send(_call(4, "list_files"))  # params neither object nor array: no JSON-RPC request at all
        assert mcp.read() == _error(4, -32600, NOT_A_MESSAGE)
        mcp.send(b'{"jsonrpc":"2.0","id":5,"method":"tools/call"}')
        assert mcp.read() == _error(5, -32602, 'tools/call: params must be an object with a "name", not null')
        # The twins: arguments as an object, null or left out are served.
        for rid, params in enumerate(({"name": "list_files", "arguments": {}},
                                      {"name": "list_files", "arguments": None}, {"name": "list_files"}), 10):
            mcp.send(_call(rid, params))
            served = mcp.read()
            assert served["id"] == rid and served["result"]["isError"] is False, served
            assert served["result"]["content"][0]["text"] == "README.md\nsrc/main.py"


def _peak_kib(pid: int) -> int:
    """The process's peak resident memory (VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_a_line_over_the_limit_is_dropped_as_it_comes_and_answered(daemon: Daemon, client: dispatch.Client,
                                                                   worktree: Path) -> None:
    size = 4 * MAX_LINE
    with started(daemon, worktree) as mcp:
        start = _peak_kib(mcp.proc.pid)
        head = b'{"jsonrpc":"2.0","id":"big","method":"tools/call","params":{"name":"write_file","arguments":' \
               b'{"path":"big.txt","content":"'
        assert mcp.proc.stdin is not None
        mcp.proc.stdin.write(head)
        for _ in range((size - len(head)) // (1 << 20)):
            mcp.proc.stdin.write(b"x" * (1 << 20))
        tail = b'"}}}'
        # Its newline, and the next line right behind it: what follows the long line is kept.
        mcp.proc.stdin.write(b"x" * ((size - len(head)) % (1 << 20) - len(tail)) + tail + b"\n")
        mcp.send(b'{"jsonrpc":"2.0","id":2,"method":"ping"}')
        assert mcp.read() == _error("big", -32600, f"Invalid Request: the line is {size} bytes, over the {MAX_LINE} "
                                                   "this server reads; it was not read")
        assert mcp.read() == {"jsonrpc": "2.0", "id": 2, "result": {}}
        # Never held whole: the peak grew by about the limit, not by the line.
        assert _peak_kib(mcp.proc.pid) - start < 2 * MAX_LINE // 1024
        assert not (worktree / "big.txt").exists()
        # The twin: a long line under the limit is served.
        content = "y" * (4 << 20)
        mcp.send(_call(3, {"name": "write_file", "arguments": {"path": "big.txt", "content": content}}))
        assert mcp.read()["result"]["isError"] is False
        assert (worktree / "big.txt").read_text() == content
