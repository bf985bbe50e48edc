"""Agent integration against a real session: the tool loop with a fake model,
approval, the policy's output budget with retrieve_output, and the docs'
examples, each run as written (a fake model standing in where no key exists).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dispatch
from dispatch.agent import FakeModel, Trace, run_tool_loop
from tests.conftest import Daemon

REPO = Path(__file__).resolve().parent.parent.parent
ALL_TOOLS = ["read_file", "write_file", "edit_file", "create_file", "list_files", "search_files", "shell_exec",
             "job_output", "job_stop", "job_list"]


def test_a_session_registry_compacts_at_the_policy_budget(session: dispatch.Session) -> None:
    budget = session.info["limits"]["model_output_bytes"]
    assert session.registry.output_budget == budget == 16384
    assert session.registry.tool_names == [*ALL_TOOLS, "retrieve_output"]
    assert [session.registry.get(n).risk for n in ALL_TOOLS] == [
        "read", "write", "write", "write", "read", "read", "execute", "read", "execute", "read"]


def test_a_loop_edits_the_worktree_and_runs_commands(session: dispatch.Session, worktree: Path) -> None:
    model = FakeModel([
        [("read_file", {"path": "src/main.py"})],
        [("edit_file", {"path": "src/main.py", "edits": [{"old_text": "return 42", "new_text": "return 43"}]})],
        [("shell_exec", {"command": "python3 -c 'import sys; sys.path.insert(0, \"src\"); "
                                    "import main; print(main.main())'"})],
        lambda messages: f"main() returns {messages[-1]['content'].strip()}",
    ])
    trace = Trace()
    result = run_tool_loop(model, session.registry, [{"role": "user", "content": "bump the answer"}], trace=trace)
    assert (result.status, result.final) == ("done", "main() returns 43")
    assert "return 43" in (worktree / "src" / "main.py").read_text()
    assert [(e.tool, e.success) for e in trace] == [("read_file", True), ("edit_file", True), ("shell_exec", True)]


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_denied_command_never_reaches_the_sandbox(session: dispatch.Session, worktree: Path,
                                                    provider: str) -> None:
    def approve(definition: dispatch.Definition, params: dict, context: object) -> bool | str:
        return "commands need a human" if definition.risk == "execute" else True

    model = FakeModel([[("shell_exec", {"command": "touch ran"}), ("write_file", {"path": "w", "content": "x"})],
                       "understood"], provider=provider)
    trace = Trace()
    result = run_tool_loop(model, session.registry.with_approval(approve), [], provider=provider, trace=trace)
    assert result.done and not (worktree / "ran").exists() and (worktree / "w").read_text() == "x"
    assert [(e.tool, e.denied) for e in trace] == [("shell_exec", True), ("write_file", False)]
    assert trace[0].content.endswith("shell_exec: denied by approval: commands need a human")


def test_invalid_and_unknown_calls_come_back_to_the_model(session: dispatch.Session) -> None:
    model = FakeModel([[("read_file", '{"path": '), ("read_file", {"path": 1}), ("set_network", {"on": True})],
                       "ok"], provider="anthropic")
    result = run_tool_loop(model, session.registry, [], provider="anthropic")
    bad_json, bad_type, unknown = result.messages[1]["content"]
    assert all(r["is_error"] for r in (bad_json, bad_type, unknown))
    assert "arguments are not valid JSON" in bad_json["content"]
    assert bad_type["content"] == "read_file: invalid arguments: $.path: 1 is not of type 'string'"
    assert unknown["content"].startswith("Unknown tool: set_network. Available tools: read_file, ")


def test_a_long_command_output_is_compacted_and_retrieved_whole(session: dispatch.Session) -> None:
    whole = session.registry.call("shell_exec", {"command": "seq 1 30000"})
    pieces: list[str] = []

    def page(messages: list) -> list | str:
        text = messages[-1]["content"]
        if not pieces:  # the compacted result: start paging from its id
            assert len(text.encode()) <= 16384 and "bytes omitted" in text
            pieces.append("")
            return [("retrieve_output", {"id": re.search(r'id "(out_\d+)"', text).group(1)})]
        body, _, footer = text.rpartition("[output out_1: ")
        pieces.append(body)
        more = re.search(r"more from start_line=(\d+)\]$", text)
        if more is None:
            return "read it all"
        return [("retrieve_output", {"id": "out_1", "start_line": int(more.group(1))})]

    model = FakeModel([[("shell_exec", {"command": "seq 1 30000"})], *[page] * 20])
    result = run_tool_loop(model, session.registry, [], max_iterations=30)
    assert result.final == "read it all"
    assert "".join(pieces) == whole.output == "".join(f"{i}\n" for i in range(1, 30001))


# -- the examples docs/agents.md shows, run as written


def _example(daemon: Daemon, name: str, worktree: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}  # the fake model, always
    env.update(DISPATCH_SOCKET=daemon.socket, PYTHONDONTWRITEBYTECODE="1", TRACE_PATH=str(tmp_path / "trace.jsonl"))
    return subprocess.run([sys.executable, str(REPO / "examples" / name), str(worktree)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def _no_sessions_left(client: dispatch.Client, worktree: Path) -> bool:
    return all(s["worktree"] != str(worktree) for s in client.list_sessions())


def test_example_openai_loop(daemon: Daemon, client: dispatch.Client, worktree: Path, tmp_path: Path) -> None:
    out = _example(daemon, "openai_loop.py", worktree, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "shell_exec: denied by approval: no recursive deletes" in out.stdout
    assert "write_file: invalid arguments: 'content' is a required property" in out.stdout
    assert out.stdout.splitlines()[-1] == "done after 4 turns: README.md ends with 'Checked by an agent.' now."
    assert (worktree / "README.md").read_text() == "hello\nworld\nChecked by an agent.\n"
    assert (worktree / "src" / "main.py").exists()  # the rm -rf was denied
    assert _no_sessions_left(client, worktree)


def test_example_anthropic_loop(daemon: Daemon, client: dispatch.Client, worktree: Path, tmp_path: Path) -> None:
    (worktree / "src" / "main.py").write_text("def main():\n    return 42\n\n\nprint(main())\n")
    (worktree / "tiny.py").write_text("print('tiny')\n")
    out = _example(daemon, "anthropic_loop.py", worktree, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "approving shell_exec (execute): {'command': 'python3 ./src/main.py'}" in out.stdout
    assert out.stdout.splitlines()[-1] == "done after 4 turns: It printed: 42"
    trace = Trace.read_jsonl(tmp_path / "trace.jsonl")
    assert [e.tool for e in trace] == ["search_files", "shell_exec", "shell_exec"]
    assert _no_sessions_left(client, worktree)


def test_example_mcp_client(daemon: Daemon, client: dispatch.Client, worktree: Path, tmp_path: Path) -> None:
    out = _example(daemon, "mcp_client.py", worktree, tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "tools: " + ", ".join([*ALL_TOOLS, "retrieve_output"])
    assert "list_files -> ok:" in lines and "  README.md" in lines
    assert "read_file -> error:" in lines and "  path escapes the worktree: '../outside'" in lines
    assert _no_sessions_left(client, worktree)


def test_the_docs_show_each_example() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Plugging into agents"):]
    agents = (REPO / "docs" / "agents.md").read_text()
    for name in ("openai_loop.py", "anthropic_loop.py", "mcp_client.py"):
        assert f"examples/{name}" in section
        assert f"examples/{name}" in agents
    # Its Python snippets are the examples' own lines (which the tests above run), not a paraphrase.
    examples = "".join((REPO / "examples" / n).read_text() for n in ("openai_loop.py", "anthropic_loop.py",
                                                                      "mcp_client.py"))
    snippets = re.findall(r"<!-- not run: an excerpt of examples/[^>]*-->\n```python\n(.*?)```", agents, re.S)
    assert len(snippets) >= 2
    for line in "".join(snippets).splitlines():
        assert line.strip() in examples, line
