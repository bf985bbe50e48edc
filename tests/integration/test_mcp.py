"""``dispatch mcp``: a real session's tools served over MCP on stdio, driven by
the official SDK's client (``stdio_client`` + ``ClientSession``) as any MCP
client would drive it.

Each test runs its coroutine with ``asyncio.run`` (no pytest plugin), and
checks afterwards that the session ``dispatch mcp`` opened was closed. How it
ends (signals with stdin open, a session ended under it) is
``test_mcp_lifetime.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TextIO

import mcp.types as types
import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

import dispatch
from tests.conftest import Daemon, running, sleepers

ALL_TOOLS = ["read_file", "write_file", "edit_file", "create_file", "list_files", "search_files", "shell_exec",
             "job_output", "job_stop", "job_list"]


def _command(daemon: Daemon, worktree: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dispatch.cli", "--socket", daemon.socket, "--no-autostart",
            "mcp", "--worktree", str(worktree), *extra]


@asynccontextmanager
async def _mcp_session(daemon: Daemon, worktree: Path, errlog: TextIO, *extra: str) -> AsyncIterator[ClientSession]:
    command = _command(daemon, worktree, *extra)
    params = StdioServerParameters(command=command[0], args=command[1:], env={"PYTHONDONTWRITEBYTECODE": "1"})
    async with stdio_client(params, errlog=errlog) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            yield session


def _run(daemon: Daemon, worktree: Path, tmp_path: Path,
         body: Callable[[ClientSession], Awaitable[Any]], *extra: str) -> Any:
    """Run ``body`` against ``dispatch mcp``; return what it returns."""
    with open(tmp_path / "mcp-stderr.log", "w+") as errlog:

        async def main() -> Any:
            async with _mcp_session(daemon, worktree, errlog, *extra) as session:
                return await body(session)

        try:
            return asyncio.run(main())
        finally:
            errlog.seek(0)
            stderr = errlog.read()
            assert "Traceback" not in stderr, stderr


def _sessions_on(client: dispatch.Client, worktree: Path) -> list[dict[str, Any]]:
    return [s for s in client.list_sessions() if s["worktree"] == str(worktree)]


def _text(result: types.CallToolResult) -> str:
    assert len(result.content) == 1 and isinstance(result.content[0], types.TextContent)
    return result.content[0].text


def test_lists_the_session_tools_with_their_schemas_and_risk(
    daemon: Daemon, client: dispatch.Client, worktree: Path, tmp_path: Path
) -> None:
    async def body(session: ClientSession) -> types.ListToolsResult:
        assert session.server_info is not None and session.server_info.name == "dispatchd"
        return await session.list_tools()

    listed = _run(daemon, worktree, tmp_path, body)
    assert [t.name for t in listed.tools] == [*ALL_TOOLS, "retrieve_output"]
    with client.open_session(str(worktree)) as s:
        expected = {d["name"]: d for d in s.registry.schemas("mcp")}
    for tool in listed.tools:
        assert tool.description == expected[tool.name]["description"]
        assert tool.input_schema == expected[tool.name]["inputSchema"]
        read_only = tool.name in ("read_file", "list_files", "search_files", "retrieve_output", "job_output", "job_list")
        assert tool.annotations is not None
        assert (tool.annotations.read_only_hint, tool.annotations.destructive_hint) == (read_only, not read_only)
    assert _sessions_on(client, worktree) == []


def test_calls_tools_in_the_sandbox(daemon: Daemon, client: dispatch.Client, worktree: Path, tmp_path: Path) -> None:
    async def body(session: ClientSession) -> dict[str, types.CallToolResult]:
        return {
            "read": await session.call_tool("read_file", {"path": "README.md"}),
            "write": await session.call_tool("write_file", {"path": "out/new.txt", "content": "from mcp\n"}),
            "shell": await session.call_tool("shell_exec", {"command": "cat out/new.txt; pwd; echo oops >&2"}),
            "failed": await session.call_tool("shell_exec", {"command": "echo partial; exit 3"}),
            "escape": await session.call_tool("read_file", {"path": "../../etc/passwd"}),
        }

    r = _run(daemon, worktree, tmp_path, body)
    assert (_text(r["read"]), r["read"].is_error) == ("0: hello\n1: world", False)
    assert r["write"].is_error is False and (worktree / "out" / "new.txt").read_text() == "from mcp\n"
    shell = _text(r["shell"])
    assert r["shell"].is_error is False
    assert "from mcp" in shell and str(worktree) in shell and "oops" in shell
    assert r["failed"].is_error is True and "partial" in _text(r["failed"])
    assert r["escape"].is_error is True and "escapes the worktree" in _text(r["escape"])
    assert _sessions_on(client, worktree) == []
    # structuredContent: the Result's metadata, without the output the text carries.
    failed = r["failed"].structured_content
    assert failed is not None and "stdout" not in failed and "stderr" not in failed
    assert (failed["success"], failed["exit_code"], failed["timed_out"], failed["truncated"]) == (False, 3, False, False)
    assert failed["duration_s"] >= 0 and set(failed["usage"]) == {"cpu_s", "peak_mib"}
    assert r["write"].structured_content is not None and r["write"].structured_content["path"] == "out/new.txt"


def test_bad_calls_are_results_a_model_can_read(daemon: Daemon, worktree: Path, tmp_path: Path) -> None:
    async def body(session: ClientSession) -> list[types.CallToolResult]:
        return [
            await session.call_tool("read_file", {"path": 3}),
            await session.call_tool("read_file", {}),
            await session.call_tool("set_network", {"state": "on"}),
        ]

    wrong_type, missing, unknown = _run(daemon, worktree, tmp_path, body)
    assert all(r.is_error for r in (wrong_type, missing, unknown))
    assert _text(wrong_type) == "read_file: invalid arguments: $.path: 3 is not of type 'string'"
    assert _text(missing) == "read_file: invalid arguments: 'path' is a required property"
    # Network switching is not a tool: the person who started the server chose it.
    assert _text(unknown).startswith("Unknown tool: set_network. Available tools: read_file,")


def test_long_output_is_compacted_and_retrievable(daemon: Daemon, worktree: Path, tmp_path: Path) -> None:
    async def body(session: ClientSession) -> tuple[str, str, str]:
        long = _text(await session.call_tool("shell_exec", {"command": "seq 1 20000"}))
        output_id = long.split('with id "', 1)[1].split('"', 1)[0]
        piece = _text(await session.call_tool("retrieve_output", {"id": output_id, "start_line": 9999,
                                                                  "end_line": 10001}))
        return long, output_id, piece

    long, output_id, piece = _run(daemon, worktree, tmp_path, body)
    assert len(long.encode()) <= 16384  # the default policy's model_output_bytes
    assert long.startswith("1\n2\n") and long.endswith("19999\n20000\n")
    assert output_id == "out_1"
    assert piece == "10000\n10001\n10002\n[output out_1: lines 9999-10001 of 20000]"


def test_policy_and_network_options_shape_the_session(
    daemon: Daemon, client: dispatch.Client, worktree: Path, tmp_path: Path
) -> None:
    async def body(session: ClientSession) -> tuple[list[str], list[dict[str, Any]]]:
        listed = await session.list_tools()
        return [t.name for t in listed.tools], _sessions_on(client, worktree)

    names, sessions = _run(daemon, worktree, tmp_path, body, "--network", "off", "--policy", "read-only")
    assert names == ["read_file", "list_files", "search_files", "retrieve_output"]
    assert [(s["network"], s["policy"]) for s in sessions] == [("off", "read-only")]
    assert _sessions_on(client, worktree) == []


def test_an_unusable_worktree_is_one_line_on_stderr_and_exit_2(daemon: Daemon, tmp_path: Path) -> None:
    out = subprocess.run(_command(daemon, tmp_path / "missing"), stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith("dispatch: ")


def test_tools_format_mcp_matches_the_listing_shape(daemon: Daemon) -> None:
    out = subprocess.run([sys.executable, "-m", "dispatch.cli", "--socket", daemon.socket, "--no-autostart",
                          "tools", "--format", "mcp"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    tools = json.loads(out.stdout)
    assert [t["name"] for t in tools] == ALL_TOOLS
    assert all(set(t) == {"name", "description", "inputSchema"} for t in tools)


def test_progress_notifications_carry_output_as_it_comes(daemon: Daemon, worktree: Path, tmp_path: Path) -> None:
    async def body(session: ClientSession) -> tuple[types.CallToolResult, list[tuple[float, float, str | None]]]:
        seen: list[tuple[float, float, str | None]] = []
        started = time.monotonic()

        async def progress(done: float, _total: float | None, message: str | None) -> None:
            seen.append((time.monotonic() - started, done, message))

        result = await session.call_tool("shell_exec", {"command": "for i in 1 2 3; do [ $i = 1 ] || sleep 1; echo step $i; done"},
                                         progress_callback=progress)
        return result, seen

    result, seen = _run(daemon, worktree, tmp_path, body)
    assert _text(result) == "step 1\nstep 2\nstep 3\n"
    assert [m for _, _, m in seen] == ["step 1\n", "step 2\n", "step 3\n"]
    assert [d for _, d, _ in seen] == [7.0, 14.0, 21.0]
    assert seen[2][0] - seen[0][0] > 1.5  # as they came, not at the end


def test_a_cancelled_request_ends_the_command(daemon: Daemon, client: dispatch.Client, worktree: Path,
                                               tmp_path: Path) -> None:
    async def body(session: ClientSession) -> None:
        with pytest.raises(TimeoutError):
            # The SDK sends notifications/cancelled for a request it stops waiting for.
            await asyncio.wait_for(session.call_tool(
                "shell_exec", {"command": "sleep 315.6; echo finished > f"}), 1.0)
        deadline = time.monotonic() + 30
        while sleepers("315.6") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert sleepers("315.6") == []
        # The server goes on.
        assert _text(await session.call_tool("shell_exec", {"command": "echo on"})) == "on\n"

    _run(daemon, worktree, tmp_path, body)
    # Neither the sleep nor the bash that would run the echo after it is left,
    # so nothing can write f from here on.
    assert running("315.6") == []
    assert not (worktree / "f").exists()



def test_output_reaches_the_client_with_no_control_a_terminal_acts_on(
        daemon: Daemon, worktree: Path, tmp_path: Path) -> None:
    """A command's output may be shown on the client's terminal: colour is
    dropped, every other control escaped (before: a clipboard write, OSC 52,
    and a carriage return that hides a line went through as they were)."""
    async def body(session: ClientSession) -> tuple[types.CallToolResult, types.CallToolResult]:
        hostile = await session.call_tool("shell_exec", {
            "command": r"printf '\033[31mred\033[0m \033]52;c;aGk=\007 safe\rhidden \342\200\256txt\n'"})
        plain = await session.call_tool("shell_exec", {"command": r"printf 'a\tb\\c\r\ncaf\303\251 \360\237\230\200\n'"})
        named = await session.call_tool("shell_exec", {"command": r"touch \"$(printf 'n\033]0;t\007')\""})
        bidi = await session.call_tool("shell_exec", {"command": r"touch \"$(printf 'b\342\200\256c')\""})
        return hostile, plain, named, bidi

    hostile, plain, named, bidi = _run(daemon, worktree, tmp_path, body)
    assert _text(hostile) == "red \\x1b]52;c;aGk=\\x07 safe\\rhidden \\u202etxt\n"
    # A name the session chose, in the structured content: shown escaped, as
    # the daemon names it (and escaped again here, were it not:
    # tests/unit/test_mcp_text.py).
    assert named.structured_content is not None
    assert all("\x1b" not in name for name in named.structured_content["changed"]), named.structured_content
    assert named.structured_content["changed"] == ['"n\\x1b]0;t\\x07"'], named.structured_content["changed"]
    # The twin: tabs, backslashes, CRLF, accents and emoji are left as they are.
    assert _text(plain) == "a\tb\\c\r\ncafé 😀\n"
    assert bidi.structured_content is not None
    assert bidi.structured_content["changed"] == ['"b\\u202ec"'], bidi.structured_content["changed"]
