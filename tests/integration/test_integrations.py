"""The LangChain and OpenAI Agents SDK adapters, against a real daemon. They
skip only where the framework cannot be imported (both are in the test extra)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

import dispatch
from tests.conftest import gone, sleepers


def test_langchain_tools_run_in_the_sandbox(session: dispatch.Session) -> None:
    pytest.importorskip("langchain_core")
    from langchain_core.tools import StructuredTool, ToolException

    from dispatch.integrations.langchain import tools

    found = {t.name: t for t in tools(session.registry)}
    assert set(found) == set(session.registry.tool_names) and all(isinstance(t, StructuredTool) for t in found.values())
    shell = found["shell_exec"]
    assert shell.args["command"]["type"] == "string"
    assert shell.invoke({"command": "echo hi"}) == "hi\n"
    assert found["read_file"].invoke({"path": "src/main.py", "end_line": 0}) == "0: import os"
    with pytest.raises(ToolException) as failed:  # a failed call raises
        shell.invoke({"command": "echo out; exit 3"})
    assert str(failed.value).startswith("command exited with status 3\nout")
    # Awaited: a cancelled task cancels the call in the sandbox.
    async def timed_out() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(shell.ainvoke({"command": "sleep 4251"}), 0.5)

    asyncio.run(timed_out())
    assert gone(lambda: sleepers("4251"))
    assert asyncio.run(shell.ainvoke({"command": "echo async"})) == "async\n"


def test_openai_agents_function_tools_run_in_the_sandbox(session: dispatch.Session) -> None:
    pytest.importorskip("agents")
    from agents import FunctionTool

    from dispatch.integrations.openai_agents import tools

    found = {t.name: t for t in tools(session.registry)}
    assert set(found) == set(session.registry.tool_names) and all(isinstance(t, FunctionTool) for t in found.values())
    shell = found["shell_exec"]
    assert shell.params_json_schema == session.registry.get("shell_exec").parameters
    ctx = SimpleNamespace(tool_call_id="call_1")

    async def main() -> tuple[str, str]:
        ok = await shell.on_invoke_tool(ctx, json.dumps({"command": "echo hi"}))  # type: ignore[arg-type]
        bad = await shell.on_invoke_tool(ctx, json.dumps({"command": "exit 3"}))  # type: ignore[arg-type]
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(shell.on_invoke_tool(ctx, '{"command": "sleep 4252"}'), 0.5)  # type: ignore[arg-type]
        return ok, bad

    ok, bad = asyncio.run(main())
    assert ok == "hi\n"
    assert bad.startswith("Error: command exited with status 3")
    assert gone(lambda: sleepers("4252"))
